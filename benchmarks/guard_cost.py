"""What the gRPC guard costs: tokens/s of gRPC streams sent straight to tritonserver and through
python_backend/server/grpc_guard.py (the proxy `mol2 serve` puts on its public gRPC port to bound message sizes), on the
demo, in one run.

Cells of `--cell-s` seconds alternate between the two paths (direct, guarded, guarded, direct, ...), at each
concurrency; in a cell, each of C client threads runs turns back to back over one gRPC stream (`mol2`, a new
conversation per turn, `ignore_eos`, `--max-tokens` tokens, ended with the turn). Rows: per concurrency and path,
the median tokens/s over the repeats with its spread, and the guarded/direct ratio of the medians; the load average
beside each (the machine's 2 cores also run the client threads, for both paths alike).

    python -m benchmarks.guard_cost [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import numpy as np

from . import load
from ._report import add_plot_option, markdown_table, median_spread, plot_path, save_figure, write_json

COLUMNS = ["concurrency", "path", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "ratio_to_direct",
           "load_avg"]


def _inputs(text: str, max_tokens: int):
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, value, kind in (("text_input", np.array([text.encode()], dtype=object), "BYTES"),
                              ("adapter", np.array([b"coding"], dtype=object), "BYTES"),
                              ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
                              ("ignore_eos", np.array([True]), "BOOL"), ("stream", np.array([True]), "BOOL"),
                              ("end_conversation", np.array([True]), "BOOL")):
        tensors.append(grpcclient.InferInput(name, [1], kind))
        tensors[-1].set_data_from_numpy(value)
    return tensors


def cell(url: str, concurrency: int, seconds: float, max_tokens: int) -> float:
    """Tokens/s of `concurrency` streams: the tokens that arrived within `seconds` of the cell's start."""
    import tritonclient.grpc as grpcclient

    counts, stop_at = [0] * concurrency, time.monotonic() + seconds

    def client_loop(index: int) -> None:
        client = grpcclient.InferenceServerClient(url)
        done = threading.Event()

        def on_response(result, error):
            if error is not None:
                raise RuntimeError(f"the server failed a turn: {error}")
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()  # the empty final response carries no token
            elif time.monotonic() <= stop_at:
                counts[index] += 1

        client.start_stream(callback=on_response)
        try:
            while time.monotonic() < stop_at:
                done.clear()
                client.async_stream_infer("mol2", _inputs(f"Reverse a list, take {index}.", max_tokens),
                                          enable_empty_final_response=True)
                done.wait(120)
        finally:
            client.stop_stream()
            client.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / seconds


class GuardThread:
    """grpc_guard.GrpcGuard on a loop of its own, in front of `upstream`."""

    def __init__(self, upstream: str):
        from python_backend.server.grpc_guard import GrpcGuard, serve_grpc_guard
        from python_backend.server.guard import ServerState
        from python_backend.server.supervisor import free_loopback_port

        self.port = free_loopback_port()
        self.loop = asyncio.new_event_loop()
        self.guard = GrpcGuard(ServerState(upstream="running", starting=False), upstream)
        self.server = self.loop.run_until_complete(serve_grpc_guard(self.guard, "127.0.0.1", self.port))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(1.0), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.guard.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short cells, 2 repeats (a smoke run)")
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3, help="cells per path and concurrency (default 3)")
    parser.add_argument("--cell-s", type=float, default=15.0, help="seconds a cell lasts (default 15)")
    parser.add_argument("--max-tokens", type=int, default=64)
    add_plot_option(parser, "artifacts/benchmarks/guard_cost.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.cell_s = 2, 5.0
    args.plot = plot_path(args)

    samples: dict[tuple[int, str], list[float]] = {}
    loads: dict[int, list[float]] = {}
    with load.demo_server("guard_cost") as (ports, _store):
        guarded = GuardThread(ports.grpc_url)
        try:
            urls = {"direct": ports.grpc_url, "guarded": f"127.0.0.1:{guarded.port}"}
            cell(urls["direct"], 2, 3.0, args.max_tokens)  # warm-up: the engine's first turns
            for concurrency in args.concurrency:
                for repeat in range(args.repeats):
                    order = ("direct", "guarded") if repeat % 2 == 0 else ("guarded", "direct")
                    for path in order:
                        rate = cell(urls[path], concurrency, args.cell_s, args.max_tokens)
                        samples.setdefault((concurrency, path), []).append(rate)
                        loads.setdefault(concurrency, []).append(load.load_avg()[0])
                        print(f"  c{concurrency} {path}: {rate:.1f} tok/s", flush=True)
        finally:
            guarded.close()
    rows = []
    for concurrency in args.concurrency:
        direct = statistics.median(samples[(concurrency, "direct")])
        for path in ("direct", "guarded"):
            median, low, high = median_spread(samples[(concurrency, path)])
            rows.append({"concurrency": concurrency, "path": path, "tokens_per_s": round(median, 1),
                         "tokens_per_s_min": round(low, 1), "tokens_per_s_max": round(high, 1),
                         "ratio_to_direct": round(median / direct, 3),
                         "load_avg": round(statistics.median(loads[concurrency]), 2)})
    print(markdown_table(rows, COLUMNS))
    write_json(rows, args.json)
    plot(rows, args.plot)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    concurrencies = sorted({row["concurrency"] for row in rows})
    for offset, name in ((-0.2, "direct"), (0.2, "guarded")):
        chosen = [next(r for r in rows if r["concurrency"] == c and r["path"] == name) for c in concurrencies]
        axis.bar([i + offset for i in range(len(concurrencies))], [r["tokens_per_s"] for r in chosen], width=0.4,
                 yerr=[[r["tokens_per_s"] - r["tokens_per_s_min"] for r in chosen],
                       [r["tokens_per_s_max"] - r["tokens_per_s"] for r in chosen]], label=name)
    axis.set_xticks(range(len(concurrencies)), [f"{c} streams" for c in concurrencies])
    axis.set_ylabel("tokens/s")
    axis.set_title("gRPC straight to tritonserver vs through grpc_guard")
    axis.legend()
    save_figure(figure, path)


if __name__ == "__main__":
    main()
