"""How near `--engine onnxruntime` can come to torch's decode step: the step's matrix products alone, on ONNX Runtime.

In-process, on the demo (the one every command uses, ced/demo.py; or --model) with its four adapters, rows b
under adapter b mod 4 after a `--context`-token prefill and a replay. Three variants, timed in turn:

- torch:                 the server's torch engine (BatchedEngine over the paged pool, the native decode kernels);
- onnxruntime:           the server's ONNX Runtime engine (OrtBatchedEngine: the `pool_step` graph, one call a step);
- onnxruntime_products:  a graph of nothing but the matrix products ONNX Runtime runs in that step (every MatMul and
                         FusedMatMul of the optimized `pool_step` graph, read from its profile, with their shapes,
                         one after another on random inputs): what ORT's own kernels take for the step's products,
                         whatever the rest of the graph (attention softmax, norms, pooling, indexer, LoRA masks) costs.

`vs_torch` is torch's ms a step over the variant's: the tokens/s ratio the variant can reach. Where
`onnxruntime_products` reads under a target ratio, no graph of ORT's own operators reaches it on this machine.
Each repeat times every variant in turn (the order alternating), so the machine's drift hits all of them; each row
carries the 1-minute load average read when its last repeat ended.

    python -m benchmarks.onnxruntime_ceiling [--quick] [--json PATH] [--plot PATH] [--rows 1,16]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ced import kernels
from ced.batched import BatchedEngine
from ced.engines import make_engine
from ced.ort_batched import OrtBatchedEngine

from ._report import add_plot_option, markdown_table, median_spread, plot_path, save_figure, write_json
from .engine_speed import add_engine_options, demo_model

COLUMNS = ["rows", "variant", "ms_per_step", "ms_min", "ms_max", "tokens_per_s", "vs_torch", "products",
           "load_1min"]
ADAPTERS = ("chat", "agent", "coding", "design")
VARIANTS = ("torch", "onnxruntime", "onnxruntime_products")
PRODUCTS = ("MatMul", "FusedMatMul", "Gemm")


def open_rows(engine: BatchedEngine, n_rows: int, context: int, adapters: list[str | None]) -> dict:
    """n_rows conversations of `context` tokens replayed under their adapters; the next tokens to step."""
    g = torch.Generator().manual_seed(0)
    rows = [engine.open() for _ in range(n_rows)]
    engine.prefill_rows(rows, [torch.randint(0, engine.config.vocab_size, (context,), generator=g).tolist()
                               for _ in rows])
    logits, _ = engine.replay(rows, adapters)
    return {"rows": rows, "adapters": adapters, "tokens": kernels.argmax_rows(logits)}


def step(engine: BatchedEngine, batch: dict, n_steps: int) -> list[float]:
    """Seconds of each of n_steps greedy decode steps of the batch (it grows by a token a row each)."""
    seconds = []
    for _ in range(n_steps):
        start = time.perf_counter()
        logits = engine.step(batch["rows"], batch["tokens"], batch["adapters"])
        seconds.append(time.perf_counter() - start)
        batch["tokens"] = kernels.argmax_rows(logits)
    return seconds


def step_products(engine: OrtBatchedEngine, batch: dict) -> list[tuple[list[list[int]], list[int]]]:
    """(operand shapes, output shape) of every product ONNX Runtime ran in one `pool_step` call of this batch, read
    from its profile (the graph as its optimizer left it; a weight's shape is not listed, a tensor of the step's is)."""
    import onnxruntime as ort

    session, built = engine.sessions["pool_step"], engine.engine
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.intra_op_num_threads = session.get_session_options().intra_op_num_threads
        options.inter_op_num_threads, options.log_severity_level = 1, 3
        options.enable_profiling, options.profile_file_prefix = True, str(Path(folder) / "step")
        graph = built.engine_dir / built.manifest["graphs"]["pool_step"]["file"]
        engine.sessions["pool_step"] = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        try:
            step(engine, batch, 1)
            events = json.loads(Path(engine.sessions["pool_step"].end_profiling()).read_text())
        finally:
            engine.sessions["pool_step"] = session
    shapes = lambda listed: [list(entry.values())[0] for entry in listed]  # noqa: E731  [{dtype: shape}, ...]
    return [(shapes(e["args"]["input_type_shape"]), shapes(e["args"]["output_type_shape"])[0]) for e in events
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["args"]["op_name"] in PRODUCTS]


def products_graph(products: list[tuple[list[list[int]], list[int]]], threads: int):
    """A session running the products one after another, each A [..., M, K] @ B [..., K, N] with the shapes ORT
    ran, and its random feeds. A weight (its shape not listed: K x N) is a weight here too; a tensor of the step
    (batched attention, the LoRA inputs) an input, laid out K before N where ORT read it transposed."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, inputs, outputs, feeds = [], [], [], [], {}
    for i, (operands, out) in enumerate(products):
        a, K = operands[0], operands[0][-1]
        feeds[f"a{i}"] = rng.standard_normal(a, dtype=np.float32)
        inputs.append(helper.make_tensor_value_info(f"a{i}", TensorProto.FLOAT, a))
        if len(operands) == 1:
            weights.append(numpy_helper.from_array(rng.standard_normal((K, out[-1]), dtype=np.float32), f"b{i}"))
        else:
            b = operands[1] if operands[1][-2] == K else operands[1][:-2] + operands[1][:-3:-1]
            feeds[f"b{i}"] = rng.standard_normal(b, dtype=np.float32)
            inputs.append(helper.make_tensor_value_info(f"b{i}", TensorProto.FLOAT, b))
        nodes.append(helper.make_node("MatMul", [f"a{i}", f"b{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "products", inputs, outputs, initializer=weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), feeds


def run_products(session, feeds: dict, n_steps: int) -> list[float]:
    seconds = []
    for _ in range(n_steps):
        start = time.perf_counter()
        session.run(None, feeds)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(torch_engine: BatchedEngine, ort_engine: OrtBatchedEngine, loaded: list[str], row_counts: list[int],
            context: int, n_steps: int, repeats: int, threads: int) -> list[dict]:
    result = []
    for n in row_counts:
        adapters = [loaded[b % len(loaded)] if loaded else None for b in range(n)]
        batches = {kind: open_rows(engine, n, context, adapters)
                   for kind, engine in (("torch", torch_engine), ("onnxruntime", ort_engine))}
        products = step_products(ort_engine, batches["onnxruntime"])
        session, feeds = products_graph(products, threads)
        timings = {"torch": lambda k: step(torch_engine, batches["torch"], k),
                   "onnxruntime": lambda k: step(ort_engine, batches["onnxruntime"], k),
                   "onnxruntime_products": lambda k: run_products(session, feeds, k)}
        for run in timings.values():  # warm-up: first calls allocate and pick kernels
            run(2)
        samples = {variant: [] for variant in VARIANTS}
        for repeat in tqdm(range(repeats), desc=f"{n} rows: repeats (every variant in turn)"):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                samples[variant].append(float(np.median(timings[variant](n_steps))))
        load = os.getloadavg()[0]
        torch_ms = 1e3 * median_spread(samples["torch"])[0]
        for variant in VARIANTS:
            ms, ms_min, ms_max = (1e3 * v for v in median_spread(samples[variant]))
            result.append(dict(rows=n, variant=variant, ms_per_step=ms, ms_min=ms_min, ms_max=ms_max,
                               tokens_per_s=n / (ms / 1e3), vs_torch=torch_ms / ms,
                               products=len(products) if variant != "torch" else None, load_1min=load))
    return result


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = list(dict.fromkeys(r["rows"] for r in rows))
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        these = [next(r for r in rows if r["rows"] == n and r["variant"] == variant) for n in counts]
        x = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(counts))]
        spread = [[r["ms_per_step"] - r["ms_min"] for r in these], [r["ms_max"] - r["ms_per_step"] for r in these]]
        axis.bar(x, [r["ms_per_step"] for r in these], width, yerr=spread, capsize=3, label=variant)
    axis.set_xticks(range(len(counts)), [f"{n} rows" for n in counts])
    axis.set(ylabel="ms a decode step (median, min-max)", title=title)
    axis.legend(fontsize=8)
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 rows only, 10 steps, 2 repeats")
    parser.add_argument("--rows", help="comma-separated row counts (default 1,4,16)")
    parser.add_argument("--context", type=int, default=100, help="tokens prefilled a row (default 100)")
    parser.add_argument("--steps", type=int, help="decode steps timed a repeat (default 40)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 5)")
    add_engine_options(parser)
    parser.add_argument("--json", help="write the table as JSON rows here")
    add_plot_option(parser, "artifacts/benchmarks/onnxruntime_ceiling.png")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    torch.set_num_threads(args.threads)
    row_counts = [int(n) for n in (args.rows or ("16" if args.quick else "1,4,16")).split(",")]
    n_steps = args.steps or (10 if args.quick else 40)
    repeats = args.repeats or (2 if args.quick else 5)
    args.model = args.model or demo_model()
    exported = make_engine("onnxruntime", args.model, engine_dir=args.onnx_dir, threads=args.threads)
    torch_engine = make_engine("torch", args.model)
    adapters = [name for name in ADAPTERS if (args.model.parent / "adapters" / name).is_dir()]
    for engine in (torch_engine, exported):
        for name in adapters:
            engine.adapters.load(name, args.model.parent / "adapters" / name)
    rows = measure(BatchedEngine(torch_engine), OrtBatchedEngine(exported, threads=args.threads), adapters,
                   row_counts, args.context, n_steps, repeats, args.threads)
    print(f"\nA decode step on {args.model} (rows of {args.context} tokens on {len(adapters)} adapters; medians with "
          f"min-max over {repeats} interleaved repeats of {n_steps} steps, {args.threads} threads)\n")
    print(markdown_table(rows, COLUMNS))
    write_json(rows, args.json)
    plot(rows, args.plot, f"ONNX Runtime's step beside torch's ({args.model.parent.name})")
    return rows


if __name__ == "__main__":
    main()
