"""Routing throughput: what routing costs a real Triton server, three setups measured side by side in one run.

(a) fixed:     the client names the adapter (no routing work).
(b) in_engine: no adapter named; the MoL2 head routes on the H19 of the turn's own prefill (the `mol2` ensemble).
(c) outside:   a client with its own router: a `route` request (a prefill of the turn, the head, nothing written),
               then the answer request naming that adapter, which prefills the turn again.

Every setup answers the same prompts, and (a) names the adapter the head picks for each prompt, so all three
generate the same tokens and differ only in how the adapter was chosen. Each turn is one new conversation (ended by
the request). The setups alternate batch by batch, in a rotating order, so the machine's drift spreads over all of
them. Clients stream over Triton gRPC, `--concurrency` conversations in flight.

With `--perf-analyzer` the same server is then measured by Triton's perf_analyzer (scripts/perf_analyzer.sh) on
the input files of perf_analyzer_configs/: (a) and (b) as one request per turn, and for (c) the route request alone
(perf_analyzer cannot chain a route request to its answer; (c)'s turn is that plus an (a)-like answer).

    python -m benchmarks.routing_throughput [--quick] [--json PATH] [--plot PATH] [--concurrency N] [--perf-analyzer]
"""

from __future__ import annotations

import argparse
import csv
import queue
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json

SETUPS = ("fixed", "in_engine", "outside")
COLUMNS = ["setup", "tokens_per_s", "tokens_per_s_ratio", "p50_latency_ms", "p95_latency_ms", "latency_ratio",
           "p50_first_token_ms", "requests", "tokens"]
PROMPTS = [
    "Tell me a joke about compilers.", "How was your weekend? Mine was quiet.", "Say something cheerful about rain.",
    "Archive every log file older than a week.", "Install the package that edits PDF files.",
    "Restart the web server and show its status.",
    "Write a Python function that merges two sorted lists.", "Fix the off-by-one error in this loop.",
    "Write a shell script that counts lines in every file.",
    "Make the header sticky with a soft shadow.", "Pick a calm colour palette for a reading app.",
    "Center the login form and round its corners.",
]


class Client:
    """One client thread's gRPC connection: a stream for answers, unary calls for route requests."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def _inputs(self, **values):
        tensors = []
        for name, value in values.items():
            array = np.array([value.encode() if isinstance(value, str) else value],
                             dtype=object if isinstance(value, str) else None)
            if array.dtype == np.int64:
                array = array.astype(np.int32)
            kind = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL"}[array.dtype]
            tensor = self.grpc.InferInput(name, [1], kind)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    def route(self, text: str) -> str:
        result = self.client.infer("route", self._inputs(text_input=text))
        return result.as_numpy("adapter")[0].decode()

    def answer(self, text: str, max_tokens: int, adapter: str | None) -> tuple[int, float, str]:
        """One streamed turn: (tokens generated, ms to the first response, adapter applied)."""
        fields = dict(text_input=text, max_tokens=max_tokens, stream=True, end_conversation=True)
        if adapter:
            fields["adapter"] = adapter
        started = time.perf_counter()
        self.client.async_stream_infer("mol2", self._inputs(**fields), enable_empty_final_response=True)
        tokens, first_ms, applied = 0, None, ""
        while True:
            result, error = self.responses.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"the server refused a turn: {error}")
            if result.get_response().outputs:
                first_ms = first_ms if first_ms is not None else (time.perf_counter() - started) * 1e3
                tokens = int(result.as_numpy("output_tokens")[0])
                applied = result.as_numpy("applied_adapter")[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return tokens, first_ms or 0.0, applied

    def turn(self, setup: str, text: str, max_tokens: int, chosen: str) -> dict:
        started = time.perf_counter()
        route_ms = 0.0
        if setup == "fixed":
            adapter = chosen
        elif setup == "in_engine":
            adapter = None
        else:
            adapter = self.route(text)
            route_ms = (time.perf_counter() - started) * 1e3
        tokens, first_ms, applied = self.answer(text, max_tokens, adapter)
        if applied != chosen:
            raise RuntimeError(f"{setup}: {text!r} was answered by {applied!r}, not the head's choice {chosen!r}")
        return {"tokens": tokens, "latency_ms": (time.perf_counter() - started) * 1e3,
                "first_token_ms": route_ms + first_ms}

    def close(self):
        self.client.stop_stream()
        self.client.close()


def run_batch(clients: list[Client], setup: str, work: list[tuple[str, str]], max_tokens: int) -> tuple[list, float]:
    """All of `work` (prompt, head's choice) through `setup` with one thread per client; (turns, wall seconds)."""
    pending: queue.Queue = queue.Queue()
    for item in work:
        pending.put(item)
    turns, failures, lock = [], [], threading.Lock()

    def worker(client: Client):
        while True:
            try:
                text, chosen = pending.get_nowait()
            except queue.Empty:
                return
            try:
                turn = client.turn(setup, text, max_tokens, chosen)
            except Exception as error:  # reported after the batch: one failure must not hang the others
                failures.append(error)
                return
            with lock:
                turns.append(turn)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return turns, time.perf_counter() - started


def measure(url: str, concurrency: int, rounds: int, repeats: int, max_tokens: int) -> list[dict]:
    clients = [Client(url) for _ in range(concurrency)]
    try:
        chosen = {text: clients[0].route(text) for text in PROMPTS}  # the head's choice: what (a) names
        work = [(text, chosen[text]) for text in PROMPTS] * repeats
        for setup in SETUPS:  # warm every path once
            run_batch(clients, setup, work[:concurrency], max_tokens)
        turns = {setup: [] for setup in SETUPS}
        seconds = {setup: 0.0 for setup in SETUPS}
        for round_number in tqdm(range(rounds), desc="rounds (fixed, in_engine, outside interleaved)"):
            order = SETUPS[round_number % 3:] + SETUPS[:round_number % 3]
            for setup in order:
                batch, wall = run_batch(clients, setup, work, max_tokens)
                turns[setup] += batch
                seconds[setup] += wall
    finally:
        for client in clients:
            client.close()
    rows = []
    for setup in SETUPS:
        latencies = sorted(t["latency_ms"] for t in turns[setup])
        tokens = sum(t["tokens"] for t in turns[setup])
        rows.append({"setup": setup, "tokens_per_s": tokens / seconds[setup],
                     "p50_latency_ms": statistics.median(latencies),
                     "p95_latency_ms": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
                     "p50_first_token_ms": statistics.median(t["first_token_ms"] for t in turns[setup]),
                     "requests": len(turns[setup]), "tokens": tokens})
    for row in rows:
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["latency_ratio"] = row["p50_latency_ms"] / rows[0]["p50_latency_ms"]
    return rows


PERF_ANALYZER_RUNS = [("fixed", "mol2", "fixed_route.json"), ("in_engine", "mol2", "in_engine_route.json"),
                      ("outside (route request only)", "route", "outside_route.json")]


def perf_analyzer_rows(root: Path, url: str, concurrency: int, quick: bool) -> list[dict]:
    """perf_analyzer on each setup's input file, one after another on the same server: infer/s and p50 latency."""
    rows = []
    for setup, model, data in PERF_ANALYZER_RUNS:
        with tempfile.NamedTemporaryFile(suffix=".csv") as report:
            command = [str(root / "scripts/perf_analyzer.sh"), "-m", model, "-i", "grpc", "-u", url,
                       "--input-data", str(root / "perf_analyzer_configs" / data),
                       "--concurrency-range", str(concurrency), "--measurement-interval",
                       "4000" if quick else "10000", "--stability-percentage", "30", "--max-trials", "8",
                       "-f", report.name]
            if model == "mol2":
                command.append("--streaming")
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:  # e.g. no stable window on a busy machine: say so, keep the other rows
                said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-2:]
                print(f"perf_analyzer failed on {setup} (exit code {done.returncode}): {' '.join(said) or 'no output'}")
                continue
            measured = next(csv.DictReader(open(report.name)))
        # perf_analyzer's latency runs to the request's final response (measured: 199-212 ms where the first token
        # came after 37-48 ms), and these inputs send no `stream`, so decode answers once: request latency.
        rows.append({"setup": setup, "model": model, "input_data": data,
                     "infer_per_s": float(measured["Inferences/Second"]),
                     "p50_latency_ms": float(measured["p50 latency"]) / 1e3})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    names = [row["setup"] for row in rows]
    left.bar(names, [row["tokens_per_s"] for row in rows], color=["#888", "#2a7", "#c63"])
    left.set_ylabel("tokens/s")
    left.set_title("throughput")
    right.bar(names, [row["p50_latency_ms"] for row in rows], color=["#888", "#2a7", "#c63"])
    right.set_ylabel("p50 turn latency (ms)")
    right.set_title("latency")
    figure.suptitle("routing cost on one Triton server: fixed route vs in-engine vs outside")
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, 8 tokens per turn (a smoke check)")
    parser.add_argument("--json", help="write the table as JSON rows")
    add_plot_option(parser, "artifacts/benchmarks/routing_throughput.png")
    parser.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    parser.add_argument("--rounds", type=int, default=4, help="batches per setup, interleaved")
    parser.add_argument("--repeats", type=int, default=2, help="times each prompt appears in a batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--engine", default="torch", choices=("torch", "onnxruntime"))
    parser.add_argument("--perf-analyzer", action="store_true",
                        help="also measure the setups with perf_analyzer (downloads it on first use)")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    if args.quick:
        args.rounds, args.repeats, args.max_tokens = 1, 1, 8

    from python_backend.server.launcher import Ports, running
    from python_backend.server.serve_cli import prepare_demo
    from python_backend.core.settings import ROOT

    model_dir = prepare_demo()
    env = {"MOL2_ENGINE": args.engine}
    if args.engine == "onnxruntime":
        from ced.engines import ensure_onnx_engine

        env["MOL2_ENGINE_DIR"] = str(ensure_onnx_engine(model_dir))
    ports = Ports.free()
    with tempfile.TemporaryDirectory() as store:
        env["MOL2_STORE_DIR"] = store
        log = ROOT / "artifacts/logs/routing_throughput.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"starting tritonserver on the demo ({model_dir}); log {log}")
        with running(ROOT / "model_repository", ports, ROOT / "artifacts/triton", log, env=env):
            rows = measure(ports.grpc_url, args.concurrency, args.rounds, args.repeats, args.max_tokens)
            perf_rows = perf_analyzer_rows(ROOT, ports.grpc_url, args.concurrency, args.quick) \
                if args.perf_analyzer else []
    print(f"\n{len(PROMPTS) * args.repeats} turns per batch, {args.rounds} batches per setup, concurrency "
          f"{args.concurrency}, {args.max_tokens} tokens max, engine {args.engine}\n")
    print(markdown_table(rows, COLUMNS))
    in_engine = next(row for row in rows if row["setup"] == "in_engine")
    print(f"\n(b)/(a) tokens/s = {in_engine['tokens_per_s_ratio']:.3f} (target >= 0.97)")
    if perf_rows:
        print("\nperf_analyzer (gRPC, concurrency {}, input files in perf_analyzer_configs/; each file's own "
              "max_tokens):\n".format(args.concurrency))
        print(markdown_table(perf_rows, ["setup", "model", "input_data", "infer_per_s", "p50_latency_ms"]))
    # one JSON list: the setup rows, then perf_analyzer's rows, each saying which table it belongs to
    write_json([{"table": "setups", **row} for row in rows] + [{"table": "perf_analyzer", **row} for row in perf_rows],
               args.json)
    plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
