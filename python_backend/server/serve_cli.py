"""`mol2 serve`: start the Triton server on this repository's model_repository/ and keep it running: supervised
(restarted when it exits unexpectedly), its HTTP behind the guard (python_backend/server/guard.py), its store held."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ..core import limits
from ..core.seal import SECRET_VARIABLE, SealError, create_secret_file
from ..core.settings import ROOT, write_demo_adapter_set
from ..core.store import StoreHold, StoreInUse, hold_store
from .grpc_guard import GrpcGuard, serve_grpc_guard
from .guard import OPEN_PATHS, Guard, GuardLimits, ServerState, serve_guard
from .keys import ENV_VARIABLE, ApiKeyError, ApiKeys, is_loopback
from .launcher import LaunchError, Ports, port_in_use, start
from .roles import PAIR_SECRET, build_prefill_repository, decode_models, single_server_models
from .supervisor import Peer, Supervisor, free_loopback_port


def prepare_demo(folder: str | None = None) -> Path:
    """The served model: `--demo FOLDER` (a demo folder or its model/), else MOL2_MODEL_DIR where the operator set
    it, else the demo every command uses (ced/demo.py): the one the Triton models find too."""
    from ced.demo import resolve_demo

    if folder is None and os.environ.get("MOL2_MODEL_DIR"):
        return Path(os.environ["MOL2_MODEL_DIR"])

    demo = resolve_demo(folder)  # the untrained one is built here, once, before the model processes start
    print(demo.describe())
    model_dir = demo.model_dir
    if not (model_dir.parent / "adapter_set.json").is_file():
        write_demo_adapter_set(model_dir)
    return model_dir


def example_request(ports: Ports, keyed: bool = False) -> str:
    body = json.dumps({"text_input": "Write a Python function that reverses a list.", "max_tokens": 32,
                       "adapter": "coding", "stream": True})
    key = ' -H "Authorization: Bearer $KEY"' if keyed else ""
    return f"curl -sN -X POST http://{ports.http_url}/v2/models/mol2/generate_stream{key} -d '{body}'"


def role_repository(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The repository and extra tritonserver arguments for the role."""
    repository = Path(args.model_repository)
    if args.role == "decode":
        loads = [f"--load-model={name}" for name in decode_models(repository)]
        return repository, ["--model-control-mode=explicit", *loads]
    if args.role == "prefill":
        if not args.decode_url:
            raise SystemExit("mol2 serve --role prefill needs --decode-url HOST:PORT (the decode server's gRPC port)")
        generated = ROOT / "artifacts" / "triton" / f"prefill-repository-{args.grpc_port}"
        relays = build_prefill_repository(repository, generated, args.decode_url)
        print(f"prefill role: {', '.join(relays)} relay decode to {args.decode_url}; repository {generated}")
        return generated, []
    if args.decode_url:
        raise SystemExit("--decode-url only applies to --role prefill")
    loads = [f"--load-model={name}" for name in single_server_models(repository)]
    return repository, ["--model-control-mode=explicit", *loads]


def engine_settings(args: argparse.Namespace, model_dir: Path) -> dict[str, str]:
    """MOL2_ENGINE / MOL2_ENGINE_DIR (and MOL2_MODEL_DIR, with --demo) for the server's models; an engine is built or
    checked once, here."""
    from ced.families import family_of

    if args.engine == "tensorrt" and family_of(model_dir).name != "ced":
        raise SystemExit(f"mol2 serve: --engine tensorrt runs the ced family only (its plans are built from those "
                         f"graphs); {model_dir} is a {family_of(model_dir).name} model: serve it with --engine torch "
                         "or onnxruntime")
    engine_dir = args.engine_dir
    if args.engine == "onnxruntime" and not engine_dir:
        from ced.engines import ensure_onnx_engine

        engine_dir = str(ensure_onnx_engine(model_dir))  # once, not once per Triton model
    if args.engine == "tensorrt":
        from ced.trt_engine import require_tensorrt

        try:
            require_tensorrt()  # a CPU machine hears what is missing now, not from every model's initialize
        except RuntimeError as error:
            raise SystemExit(f"mol2 serve: {error}") from None
        if not engine_dir:
            raise SystemExit("--engine tensorrt needs --engine-dir (python -m engine_build tensorrt ...)")
    chosen = {"MOL2_MODEL_DIR": str(model_dir.resolve())} if args.demo else {}
    return {"MOL2_ENGINE": args.engine, "MOL2_ENGINE_DIR": engine_dir or "", **chosen}


def secret_settings(args: argparse.Namespace) -> dict[str, str]:
    """MOL2_SECRET_FILE: --secret-file, else one file the two servers of a pair in this checkout share, else a
    fresh one for this run (kept over tritonserver restarts), named by the public HTTP port no other live server
    has."""
    fresh = args.secret_file is None and args.role == "all"
    path = args.secret_file or (PAIR_SECRET if args.role != "all" else
                                ROOT / "artifacts" / "triton" / "secrets" / f"http-{args.http_port}")
    try:
        return {SECRET_VARIABLE: str(create_secret_file(path, replace=fresh))}
    except SealError as error:
        raise SystemExit(f"mol2 serve: {error}") from None


def limit_settings(args: argparse.Namespace) -> dict[str, str]:
    """MOL2_STORE_DIR and the limits the flags set, for every model process (python_backend/core/serving.py)."""
    env = {"MOL2_STORE_DIR": str(Path(args.store).resolve())}
    for name in ("idle_timeout_s", "max_prompt_tokens", "max_conversations", "max_store_bytes"):
        if getattr(args, name) is not None:
            env[f"MOL2_{name.upper()}"] = str(getattr(args, name))
    try:  # refused here, once, rather than by every model's initialize
        limits.from_settings({name[5:].lower(): value for name, value in env.items() if name != "MOL2_STORE_DIR"})
    except ValueError as error:
        raise SystemExit(f"mol2 serve: {error}") from None
    return env


def stream_settings(args: argparse.Namespace) -> dict[str, str]:
    """MOL2_STREAM_INTERVAL_MS for the decode model, checked here once (python_backend/triton/decode_model.py)."""
    if args.stream_interval_ms is None:
        return {}
    from ..core.settings import stream_interval_s

    try:
        stream_interval_s(str(args.stream_interval_ms))
    except ValueError as error:
        raise SystemExit(f"mol2 serve: --{error}".replace("stream_interval_ms", "stream-interval-ms")) from None
    return {"MOL2_STREAM_INTERVAL_MS": str(args.stream_interval_ms)}


def hold(args: argparse.Namespace, public: Ports) -> StoreHold | None:
    """The store, for this server's life (a decode server keeps none)."""
    if args.role == "decode":
        return None
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "http": public.http_url, "grpc": public.grpc_url,
             "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        return hold_store(args.store, owner)
    except StoreInUse as error:
        raise SystemExit(f"mol2 serve: {error}") from None


def api_keys(args: argparse.Namespace) -> ApiKeys:
    """The keys of --api-key, --api-key-file and MOL2_API_KEY; a one-line warning when a port off this machine takes
    requests without one."""
    try:
        keys = ApiKeys.load(args.api_key, args.api_key_file, os.environ.get(ENV_VARIABLE))
    except ApiKeyError as error:
        raise SystemExit(f"mol2 serve: {error}") from None
    if not keys and not is_loopback(args.host):
        print(f"mol2 serve: warning: {args.host} is not loopback and no API key is set (--api-key, --api-key-file, "
              f"{ENV_VARIABLE}): anyone who reaches these ports may use them, adapter loading included",
              file=sys.stderr, flush=True)
    return keys


def allowed_origins(text: str | None) -> tuple[str, ...]:
    origins = tuple(origin.strip().rstrip("/") for origin in (text or "").split(",") if origin.strip())
    if "*" in origins and len(origins) > 1:
        raise SystemExit("mol2 serve: --allowed-origins is '*' or a list of origins, not both")
    bad = [origin for origin in origins if origin != "*" and "://" not in origin]
    if bad:
        raise SystemExit(f"mol2 serve: --allowed-origins: {bad[0]!r} is not an origin (scheme://host[:port])")
    return origins


def serve(args: argparse.Namespace) -> None:
    """`mol2 serve` (its options: python_backend/server/cli.py)."""
    args.max_body_bytes = GuardLimits.max_body_bytes if args.max_body_bytes is None else args.max_body_bytes
    args.max_json_depth = GuardLimits.max_json_depth if args.max_json_depth is None else args.max_json_depth
    args.max_unsent_bytes = GuardLimits.max_unsent_bytes if args.max_unsent_bytes is None else args.max_unsent_bytes
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args.keys, args.origins = api_keys(args), allowed_origins(args.allowed_origins)
    public = Ports(args.http_port, args.grpc_port, args.metrics_port, args.host)
    busy = [port for port in (public.http, public.grpc, public.metrics) if port_in_use(public.host, port)]
    if busy:
        raise SystemExit(f"mol2 serve: port(s) {', '.join(map(str, busy))} on {public.host} already in use (another "
                         "server?): stop it or choose other ports (--http-port, --grpc-port, --metrics-port)")
    limit_env = limit_settings(args)
    store = hold(args, public)  # before anything is built or started: a second server on the store stops here
    if args.openai_port and args.role != "decode" and port_in_use(public.host, args.openai_port):
        raise SystemExit(f"mol2 serve: port {args.openai_port} on {public.host} already in use: choose another "
                         "--openai-port (0: no OpenAI API)")
    model_dir = prepare_demo(args.demo)
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    repository, extra_args = role_repository(args)
    env = {**engine_settings(args, model_dir), **secret_settings(args), **limit_env, **stream_settings(args)}
    if "MOL2_MODEL_DIR" in env:  # the OpenAI front end, in this process, resolves the model as the engine does
        os.environ["MOL2_MODEL_DIR"] = env["MOL2_MODEL_DIR"]
    adapter_set = os.environ.get("MOL2_ADAPTER_SET") or model_dir.parent / "adapter_set.json"
    print(f"serving {model_dir} (adapters: {adapter_set}); role {args.role}; engine "
          f"{args.engine}; store {env['MOL2_STORE_DIR']}; log: {args.log}")
    # tritonserver listens on loopback ports of its own, behind the guards (HTTP: guard.py, gRPC: grpc_guard.py); its
    # gRPC port is chosen once and kept over restarts, so the OpenAI front end's connection to it outlives them
    internal_grpc = free_loopback_port()
    extra_args = [*extra_args, "--grpc-address=127.0.0.1", "--http-address=127.0.0.1", "--metrics-address=127.0.0.1"]
    launch = lambda ports: start(repository, ports, ROOT / "artifacts/triton", Path(args.log), extra_args,  # noqa
                                 env=env)
    peers = (Peer(args.decode_url, tuple(decode_models(Path(args.model_repository)))),) if args.role == "prefill" \
        else ()
    state = ServerState(role=args.role, details={
        "http": public.http_url, "grpc": public.grpc_url, "metrics": f"{public.host}:{public.metrics}",
        "store": None if store is None else env["MOL2_STORE_DIR"],
        "limits": {"max_body_bytes": args.max_body_bytes, "max_json_depth": args.max_json_depth,
                   "max_unsent_bytes": args.max_unsent_bytes,
                   **{name[5:].lower(): value for name, value in env.items() if name.startswith("MOL2_MAX")
                      or name == "MOL2_IDLE_TIMEOUT_S"}}})
    guard = Guard(state, GuardLimits(args.max_body_bytes, args.max_json_depth, args.max_unsent_bytes),
                  keys=args.keys)
    if args.keys:
        print(f"API keys: {len(args.keys)}, asked on the HTTP port (open: {', '.join(OPEN_PATHS)}) and the OpenAI "
              "port (open: /health); the gRPC and metrics ports take none", flush=True)
    grpc_guard = GrpcGuard(state, f"127.0.0.1:{internal_grpc}", args.max_grpc_message_bytes)
    supervisor = Supervisor(state, launch, internal_grpc, peers)
    try:
        asyncio.run(_serve(args, public, guard, grpc_guard, supervisor))
    except LaunchError as error:
        raise SystemExit(f"mol2 serve: {error}; see {args.log}") from None
    finally:
        if store is not None:
            store.release()


OPENAI_MODEL = {"all": "engine", "prefill": "mol2"}  # what the OpenAI API streams its requests to, per role


def start_openai(args: argparse.Namespace, public: Ports, grpc: str):
    """The OpenAI-compatible API (python_backend/server/openai_api) in this process, talking over tritonserver's
    loopback gRPC port `grpc` to `engine`, or on a prefill server to the `mol2` relay (decode on the decode server);
    None when --openai-port is 0 or on a decode server (its models serve the prefill server only)."""
    if not args.openai_port or args.role == "decode":
        return None
    from .openai_api import OpenAIServer, OpenAISettings

    # the model and adapter set: resolved as the engine resolves them (the same MOL2_* variables)
    settings = OpenAISettings(grpc, engine_model=OPENAI_MODEL[args.role],
                              adapters_root=Path(args.adapters_root) if args.adapters_root else None,
                              max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes,
                              max_json_depth=args.max_json_depth, max_unsent_bytes=args.max_unsent_bytes,
                              api_keys=args.keys, allowed_origins=args.origins, max_n=args.max_n,
                              max_stored_responses=args.max_stored_responses)
    try:
        front = OpenAIServer(settings, public.host, args.openai_port).start()
    except RuntimeError as error:
        raise LaunchError(str(error)) from None
    body = json.dumps({"model": "coding", "messages": [{"role": "user", "content": "Reverse a list in Python."}],
                       "max_tokens": 32})
    key = ' -H "Authorization: Bearer $KEY"' if args.keys else ""
    print(f"OpenAI API: {front.url}/v1  (models: {front.url}/v1/models, metrics: {front.url}/metrics)\n  curl -s "
          f"{front.url}/v1/chat/completions -H 'Content-Type: application/json'{key} -d '{body}'", flush=True)
    return front


async def _serve(args: argparse.Namespace, public: Ports, guard: Guard, grpc_guard: GrpcGuard,
                 supervisor: Supervisor) -> None:
    stopping, ready = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        print("stopping tritonserver", flush=True)
        stopping.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    runners = await serve_guard(guard, public.host, public.http, public.metrics)
    grpc_server = await serve_grpc_guard(grpc_guard, public.host, public.grpc)
    front = None  # the OpenAI API, once tritonserver is ready
    supervising = asyncio.create_task(supervisor.run(stopping, ready))
    waiting = asyncio.create_task(ready.wait())
    try:
        await asyncio.wait([supervising, waiting], return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            while guard.state.not_ready_reasons() and not stopping.is_set() and not supervising.done():
                await asyncio.sleep(0.2)  # a prefill server: until its decode server answers
            print(f"ready: HTTP http://{public.http_url} (guarded)  gRPC {public.grpc_url}  metrics "
                  f"http://{public.host}:{public.metrics}/metrics  status http://{public.http_url}/v2/status",
                  flush=True)
            if args.role != "decode":
                print(f"try:\n  {example_request(public, bool(args.keys))}", flush=True)
            front = await asyncio.to_thread(start_openai, args, public, grpc_guard.upstream)
            if args.ready_only:
                stopping.set()
        await supervising  # raises the first start's LaunchError
    finally:
        stopping.set()
        waiting.cancel()
        if front is not None:
            await asyncio.to_thread(front.stop)
        if not supervising.done():
            await supervising
        await grpc_server.stop(grace=1.0)
        await grpc_guard.close()
        for runner in runners:
            await runner.cleanup()
