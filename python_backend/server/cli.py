"""`mol2 serve` and `mol2 repo`: their options. `mol2 serve --help` reads this module alone, so it imports nothing
heavy; the commands themselves (serve_cli.py, repo_build.py) load torch, the guard and Triton's client when they run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..core import limits
from .roles import PAIR_SECRET, ROLES

ROOT = Path(__file__).resolve().parents[2]
# ced.engines.ENGINE_KINDS, written out: importing ced loads torch (tests/test_layout.py keeps the two equal)
ENGINE_KINDS = ("torch", "onnxruntime", "tensorrt")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _serve(args: argparse.Namespace) -> None:
    from .serve_cli import serve

    serve(args)


def _repo_build(args: argparse.Namespace) -> None:
    from .repo_build import build

    print("wrote", ", ".join(build(args.adapter_set, args.repository, args.name, args.router_dir)),
          f"into {args.repository}\nserve it: mol2 serve --model-repository {args.repository}")


def add_serve(commands, **options) -> None:
    parser = commands.add_parser("serve", **options,
                                 description="Start tritonserver on model_repository/ (loopback by default), wait "
                                             "until it is ready, print the endpoints; Ctrl-C or SIGTERM stops it.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP, behind the guard (default %(default)s)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC (default %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics (default %(default)s)")
    parser.add_argument("--model-repository", default=str(ROOT / "model_repository"))
    parser.add_argument("--demo", help="the demo to serve: a folder built by `mol2 build demo` or published in models/ "
                                       "(e.g. models/demo-v41, the DeepSeek-V4.1-layout demo), or its model/ folder; "
                                       "default: the demo every command uses (artifacts/demo, else models/demo)")
    parser.add_argument("--log", default=str(ROOT / "artifacts/logs/tritonserver.log"), help="server log file")
    parser.add_argument("--role", choices=ROLES, default="all",
                        help="all: one server does everything (default). Disaggregated: 'decode' serves only the "
                             "decode models; 'prefill' tokenizes, prefills, routes and relays each turn to the "
                             "decode server (--decode-url), keeping the conversation store")
    parser.add_argument("--decode-url", help="with --role prefill: the decode server's gRPC endpoint, HOST:PORT")
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="torch",
                        help="what runs the CED stages: the PyTorch engine, the exported ONNX graphs under ONNX "
                             "Runtime (exported on first use), or TensorRT engines (GPU; --engine-dir)")
    parser.add_argument("--engine-dir", help="a built engine folder (mol2 build onnx | tensorrt)")
    parser.add_argument("--secret-file", help="the secret that seals the internal stages' inputs (created 0600 if "
                                              "missing); both servers of a disaggregated pair need the same file "
                                              f"(default for --role prefill/decode: {PAIR_SECRET.relative_to(ROOT)}; "
                                              "otherwise a fresh one per start)")
    parser.add_argument("--store", default=os.environ.get("MOL2_STORE_DIR") or str(ROOT / "artifacts/conversations"),
                        help="the conversation store (default artifacts/conversations); one live server per store: a "
                             "second one is refused, naming the first")
    parser.add_argument("--max-prompt-tokens", type=int,
                        help="longest prompt of one request, in tokens (default "
                             f"{limits.DEFAULTS['max_prompt_tokens']:,})")
    parser.add_argument("--max-conversations", type=int,
                        help=f"conversations the store keeps; a new one over it is refused (default "
                             f"{limits.DEFAULTS['max_conversations']:,}; 0: no limit)")
    parser.add_argument("--max-store-bytes", help="bytes the store keeps, e.g. 8G; a new conversation over it is "
                                                  "refused (default 8G; 0: no limit)")
    parser.add_argument("--idle-timeout-s", type=float, help="a conversation idle this long ends (default 3600)")
    parser.add_argument("--stream-interval-ms", type=float,
                        help="--role decode: a turn's streamed tokens go out at most this often, those between "
                             "gathered into one response (default 0: each as soon as it can). Fewer messages a token "
                             "on both hops of a pair, each token up to this much later (docs/disaggregated.md)")
    # left None here, filled from guard.GuardLimits when serving (the guard imports aiohttp: not for --help)
    parser.add_argument("--max-body-bytes", type=limits.parse_size,
                        help="largest HTTP request body, on the Triton and the OpenAI port; larger ones get 413 (default 4M)")
    parser.add_argument("--max-json-depth", type=int,
                        help="deepest JSON nesting of an HTTP request, on both ports; deeper ones get 400 (default 64)")
    parser.add_argument("--max-unsent-bytes", type=limits.parse_size,
                        help="output of one HTTP stream its client has not taken yet, on both ports; a client further "
                             "behind has its stream ended with an error event (default 1M)")
    parser.add_argument("--max-grpc-message-bytes", type=limits.parse_size, default=64 << 20,
                        help="largest gRPC message (a request, or a conversation's state sent to a decode server); "
                             "larger ones get RESOURCE_EXHAUSTED (default 64M)")
    parser.add_argument("--openai-port", type=int, default=9000,
                        help="port of the OpenAI-compatible API (/v1/chat/completions, /v1/models, ...) on --host, "
                             "started once tritonserver is ready (default 9000; 0: off; not on --role decode)")
    parser.add_argument("--max-n", type=_at_least_one, default=8,
                        help="most choices (n) one OpenAI chat or completions request may ask for (default 8)")
    parser.add_argument("--max-stored-responses", type=_at_least_one, default=1024,
                        help="responses the OpenAI port keeps for previous_response_id and GET /v1/responses/{id}, "
                             "in memory; past it the oldest are dropped (default 1024)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="a key clients must send as 'Authorization: Bearer KEY' on the OpenAI port and the HTTP "
                             "port (repeat for several; also --api-key-file, MOL2_API_KEY); health probes stay open. "
                             "Default: no key, every request passes")
    parser.add_argument("--api-key-file", metavar="FILE", help="a file of API keys, one per line (# comments)")
    parser.add_argument("--allowed-origins", metavar="ORIGINS",
                        help="CORS on the OpenAI port: a comma-separated list of origins "
                             "(https://app.example.com,...) or '*' (default: no CORS headers)")
    parser.add_argument("--adapters-root", help="the folder a /v1/load_lora_adapter lora_path must lie in (default: "
                                                "adapters/ beside the adapter set)")
    parser.add_argument("--ready-only", action="store_true", help="exit once the server answers ready (smoke test)")
    parser.set_defaults(run=_serve)


def add_repo(commands, **options) -> None:
    repo = commands.add_parser("repo", **options).add_subparsers(dest="repo_command", required=True)
    parser = repo.add_parser("build", help="add an ensemble mol2_<set> for an adapter-set file",
                             description="Generate router_<set>, decode_<set> and the ensemble mol2_<set> for an "
                                         "adapter-set JSON file (name, path, description per adapter; route_prompt).")
    parser.add_argument("--adapter-set", required=True, type=Path, help="the adapter-set JSON file")
    parser.add_argument("--name", help="the set's name (default: from the file name)")
    parser.add_argument("--repository", type=Path, default=ROOT / "artifacts" / "model_repository",
                        help="model repository to write into; a new one starts as a copy of model_repository/ "
                             "(default: artifacts/model_repository, never the committed repository)")
    parser.add_argument("--router-dir", type=Path, help="the set's router head (default: a router/ folder beside "
                                                        "the set's file, else the served model's head)")
    parser.set_defaults(run=_repo_build)
