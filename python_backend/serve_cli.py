"""`mol2 serve`: start the Triton server on this repository's model_repository/ and keep it running."""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

from ced.engines import ENGINE_KINDS

from .launcher import LaunchError, Ports, start, stop, wait_ready
from .roles import ROLES, build_prefill_repository, decode_models, single_server_models
from .serving import ROOT, demo_model_dir, write_demo_adapter_set


def prepare_demo() -> Path:
    """The served model: the trained demo if built, else the untrained one (built on first use)."""
    from ced.demo import demo_artifacts

    demo_artifacts()  # builds the untrained demo on first use when no trained one is committed
    model_dir = demo_model_dir()
    if not (model_dir.parent / "adapter_set.json").is_file():
        write_demo_adapter_set(model_dir)
    return model_dir


def example_request(ports: Ports) -> str:
    body = json.dumps({"text_input": "Write a Python function that reverses a list.", "max_tokens": 32,
                       "adapter": "coding", "stream": True})
    return f"curl -sN -X POST http://{ports.http_url}/v2/models/mol2/generate_stream -d '{body}'"


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="start the Triton server (prefill -> route -> decode)",
                                 description="Start tritonserver on model_repository/ (loopback by default), wait "
                                             "until it is ready, print the endpoints; Ctrl-C or SIGTERM stops it.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--model-repository", default=str(ROOT / "model_repository"))
    parser.add_argument("--log", default=str(ROOT / "artifacts/logs/tritonserver.log"), help="server log file")
    parser.add_argument("--role", choices=ROLES, default="all",
                        help="all: one server does everything (default). Disaggregated: 'decode' serves only the "
                             "decode models; 'prefill' tokenizes, prefills, routes and relays each turn to the "
                             "decode server (--decode-url), keeping the conversation store")
    parser.add_argument("--decode-url", help="with --role prefill: the decode server's gRPC endpoint, HOST:PORT")
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="torch",
                        help="what runs the CED stages: the PyTorch engine, the exported ONNX graphs under ONNX "
                             "Runtime (exported on first use), or TensorRT engines (GPU; --engine-dir)")
    parser.add_argument("--engine-dir", help="a built engine folder (python -m engine_build onnx | tensorrt)")
    parser.add_argument("--ready-only", action="store_true", help="exit once the server answers ready (smoke test)")
    parser.set_defaults(run=serve)


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
    """MOL2_ENGINE / MOL2_ENGINE_DIR for the server's models; an engine is built or checked once, here."""
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
    return {"MOL2_ENGINE": args.engine, "MOL2_ENGINE_DIR": engine_dir or ""}


def serve(args: argparse.Namespace) -> None:
    model_dir = prepare_demo()
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port, args.host)
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    repository, extra_args = role_repository(args)
    env = engine_settings(args, model_dir)
    print(f"serving {model_dir} (adapters: {model_dir.parent / 'adapter_set.json'}); role {args.role}; engine "
          f"{args.engine}; log: {args.log}")
    process = start(repository, ports, ROOT / "artifacts/triton", Path(args.log), extra_args, env=env)
    stopping = {"now": False}

    def on_signal(signum, frame):
        stopping["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        wait_ready(process, ports)
        print(f"ready: HTTP http://{ports.http_url}  gRPC {ports.grpc_url}  metrics "
              f"http://{ports.host}:{ports.metrics}/metrics")
        if args.role != "decode":
            print(f"try:\n  {example_request(ports)}")
        while not stopping["now"] and not args.ready_only:
            if process.poll() is not None:
                raise LaunchError(f"tritonserver exited with code {process.returncode}; see {args.log}")
            time.sleep(0.5)
    finally:
        print("stopping tritonserver")
        stop(process)
