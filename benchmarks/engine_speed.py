"""Engine speed: tokens/s of prefill, replay and decode for each engine kind, interleaved in one run.

Every engine serves the demo (the one every command uses, ced/demo.py; or --model) with its four adapters; replay
and decode run under one of them. Engines: `torch` (CEDEngine, one conversation's objects), `torch_serving` (the
BatchedEngine the server runs, over its paged pool, one row, with the native decode kernels of ced/kernels),
`torch_serving_no_kernels` (the same engine with the kernels turned off: torch's arithmetic), `onnxruntime` (and
`tensorrt`), `onnxruntime_serving` (the server's engine on ONNX Runtime, ced/ort_batched.py: the same pool, its model
calls the pool graphs). A `deepseek_v41` model (`--model models/demo-v41/model`) has three: `torch_serving`
(V41Engine, which the server runs, its prefill chunks, replays and decode steps one native call each), `torch` (the
same engine with the kernels off) and `onnxruntime` (OrtV41Engine on the family's exported graphs,
ced/deepseek_v41/onnx_export.py).
Each repeat times every engine in turn on the same work, so drift of the machine spreads over all rows:

- prefill: a fresh conversation's `--context` tokens through the adapter-free stage (chunks of 256);
- replay:  a switch at that context: the last W positions through the decoder under the adapter;
- decode:  `--decode` greedy steps after the replay (each step runs both stages for one token; its token is the
           logits' argmax as the server's scheduler picks it, kernels.argmax_rows, for every engine).

The `floor` row is the time one thread takes to read the bytes a decode step must read (every weight once, the
tied embedding as the head; of a MoE's routed experts only the share a token uses, top-k of n; 2 bytes a weight
where the checkpoint's values are bfloat16s, as the kernels read them) from memory, timed in the same repeats;
`vs_floor` is each decode row's ms over it.

    python -m benchmarks.engine_speed [--quick] [--json PATH] [--plot PATH] [--trt-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ced import kernels
from ced.batched import BatchedEngine
from ced.ort_batched import OrtBatchedEngine
from ced.engines import make_engine
from ced.families import family_of

from ._report import add_plot_option, markdown_table, median_spread, plot_path, save_figure, write_json

COLUMNS = ["engine", "phase", "tokens", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "ms", "ms_min",
           "ms_max", "speedup_vs_torch", "vs_floor"]
ADAPTERS = ("chat", "agent", "coding", "design")


class ServingEngine:
    """The server's engine (a BatchedEngine over the paged pool, on torch or ONNX Runtime) behind the serial verbs
    this benchmark calls, one row at a time; `native=False` runs it with the kernels turned off."""

    def __init__(self, batched: BatchedEngine, native: bool = True):
        self.batched = batched
        self.config, self.adapters = batched.config, batched.adapters
        self.native, self._row = native, None

    def _mode(self):
        return contextlib.nullcontext() if self.native else kernels.turned_off()

    def new_conversation(self):
        if self._row is not None:
            self.batched.close(self._row)
        self._row = self.batched.open()
        return self._row

    def prefill(self, row, tokens: list[int]) -> None:
        with self._mode():
            for start in range(0, len(tokens), 256):
                self.batched.prefill(row, tokens[start: start + 256])

    def replay(self, row, adapter):
        with self._mode():
            logits, counts = self.batched.replay([row], [adapter])
        return logits[0], counts[0]

    def step(self, row, token: int, adapter):
        with self._mode():
            return self.batched.step([row], [token], [adapter])[0]


class Kernels:
    """An engine's verbs with the native kernels on or off (`native`)."""

    def __init__(self, engine, native: bool):
        self.engine, self.native = engine, native
        self.config, self.adapters, self.model = engine.config, engine.adapters, engine.model

    def _mode(self):
        return contextlib.nullcontext() if self.native else kernels.turned_off()

    def new_conversation(self):
        return self.engine.new_conversation()

    def prefill(self, state, tokens: list[int]) -> None:
        with self._mode():
            self.engine.prefill(state, tokens)

    def replay(self, state, adapter):
        with self._mode():
            return self.engine.replay(state, adapter)

    def step(self, state, token: int, adapter):
        with self._mode():
            return self.engine.step(state, token, adapter)


class Floor:
    """Reads `nbytes` of float32 once (a sum over them): the memory floor of a decode step that reads that much."""

    def __init__(self, nbytes: int):
        self.data = torch.ones(nbytes // 4)

    def read(self) -> float:
        return timed(lambda: float(self.data.sum()))


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step of one row reads: every weight once (a tied weight counted once), a
    matrix at 2 bytes a value where its values are bfloat16s (a bfloat16 checkpoint's: the kernels pack it so,
    ced/kernels; vectors such as norms stay float32); a deepseek_v41 model's embedding is read a row at a time (its
    head is separate) and of its routed experts only the top-k of n a token is sent to."""
    width = lambda p: 2 if p.dim() == 2 and kernels.bf16_exact(p) else p.element_size()  # noqa: E731
    nbytes = lambda params: sum(p.numel() * width(p) for p in params)  # noqa: E731
    config = model.config
    if getattr(config, "n_routed_experts", 0):
        routed = [p for name, p in model.named_parameters() if ".ffn.experts." in name]
        rest = [p for name, p in model.named_parameters() if ".ffn.experts." not in name and name != "embed.weight"]
        return nbytes(rest) + nbytes(routed) * config.num_experts_per_tok // config.n_routed_experts
    return nbytes(model.parameters())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_phases(engine, history: list[int], adapter: str, n_decode: int) -> dict[str, tuple[int, float]]:
    """(tokens, seconds) per phase on a fresh conversation."""
    state = engine.new_conversation()
    prefill_s = timed(lambda: engine.prefill(state, history))
    logits = None

    def replay():
        nonlocal logits
        logits, _ = engine.replay(state, adapter)

    replay_s = timed(replay)
    replayed = min(engine.config.window, state.length)

    def decode():
        current = logits
        for _ in range(n_decode):
            current = engine.step(state, kernels.argmax_rows(current)[0], adapter)

    decode_s = timed(decode)
    return {"prefill": (len(history), prefill_s), "replay": (replayed, replay_s), "decode": (n_decode, decode_s)}


def measure(engines: dict, history: list[int], adapter: str, n_decode: int, repeats: int,
            floor: Floor) -> list[dict]:
    for engine in engines.values():  # warm-up: first calls allocate and (ORT) pick kernels
        run_phases(engine, history[:64], adapter, 2)
    seconds = {(kind, phase): [] for kind in engines for phase in ("prefill", "replay", "decode")}
    floor_s, counts = [], {}
    for _ in tqdm(range(repeats), desc="repeats (every engine in turn)"):
        for kind, engine in engines.items():
            for phase, (n, s) in run_phases(engine, history, adapter, n_decode).items():
                seconds[(kind, phase)].append(s)
                counts[phase] = n
        floor_s.append(min(floor.read() for _ in range(5)))  # one step's worth of reads, its best of 5
    floor_ms = 1e3 * median_spread(floor_s)[0]
    rows = []
    for phase in ("prefill", "replay", "decode"):
        torch_rate = None
        for kind in engines:
            ms, ms_min, ms_max = (1e3 * v for v in median_spread(seconds[(kind, phase)]))
            rate = counts[phase] / (ms / 1e3)
            torch_rate = rate if kind == "torch" else torch_rate
            rows.append(dict(engine=kind, phase=phase, tokens=counts[phase], tokens_per_s=rate,
                             tokens_per_s_min=counts[phase] / (ms_max / 1e3),
                             tokens_per_s_max=counts[phase] / (ms_min / 1e3), ms=ms, ms_min=ms_min, ms_max=ms_max,
                             speedup_vs_torch=rate / torch_rate if torch_rate else float("nan"),
                             vs_floor=ms / counts[phase] / floor_ms if phase == "decode" else float("nan")))
    n = counts["decode"]
    rows.append(dict(engine="floor", phase="decode", tokens=n, tokens_per_s=1e3 / floor_ms, tokens_per_s_min=None,
                     tokens_per_s_max=None, ms=floor_ms * n, ms_min=None, ms_max=None, speedup_vs_torch=None,
                     vs_floor=1.0))
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["prefill", "replay", "decode"]
    kinds = list(dict.fromkeys(r["engine"] for r in rows if r["engine"] != "floor"))
    figure, axis = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        these = [next(r for r in rows if r["engine"] == kind and r["phase"] == p) for p in phases]
        x = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(phases))]
        axis.bar(x, [r["tokens_per_s"] for r in these], width, label=kind,
                 yerr=[[r["tokens_per_s"] - r["tokens_per_s_min"] for r in these],
                       [r["tokens_per_s_max"] - r["tokens_per_s"] for r in these]], capsize=3)
    floor = next(r for r in rows if r["engine"] == "floor")
    axis.hlines(floor["tokens_per_s"], 1.6, 2.4, colors="black", linestyles="dashed",
                label="decode floor (weights read once)")
    axis.set_xticks(range(len(phases)), phases)
    axis.set(yscale="log", ylabel="tokens/s (median, min-max)", title=title)
    axis.legend(fontsize=8, loc="upper right")
    save_figure(figure, path)


def add_engine_options(parser) -> None:
    """--threads, --model and --onnx-dir, as the engine benchmarks take them."""
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and ONNX Runtime threads (default 1: steadiest on a shared machine, as the server "
                             "runs them)")
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the demo's, ced/demo.py)")
    parser.add_argument("--onnx-dir", type=Path, help="built ONNX engine (default: exported once and cached)")


def demo_model() -> Path:
    """The demo every command uses (ced/demo.py), said as the benchmark starts."""
    from ced.demo import resolve_demo

    demo = resolve_demo()
    print(demo.describe())
    return demo.model_dir


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="512-token context, 16 decode steps, 3 repeats")
    parser.add_argument("--context", type=int, help="tokens prefilled (default 2048)")
    parser.add_argument("--decode", type=int, help="decode steps (default 64)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 7)")
    add_engine_options(parser)
    parser.add_argument("--trt-dir", type=Path, help="built TensorRT engine: adds a tensorrt row (GPU)")
    parser.add_argument("--json", help="write the table as JSON rows here")
    add_plot_option(parser, "artifacts/benchmarks/engine_speed.png")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    torch.set_num_threads(args.threads)
    context = args.context or (512 if args.quick else 2048)
    n_decode = args.decode or (16 if args.quick else 64)
    repeats = args.repeats or (3 if args.quick else 7)
    args.model = args.model or demo_model()

    serving, cpus = make_engine("torch", args.model), len(os.sched_getaffinity(0))  # chunk threads as the server's
    family = family_of(args.model).name
    if family == "deepseek_v41":  # the server runs V41Engine itself (through RowEngine)
        engines = {"torch": Kernels(serving, native=False), "torch_serving": Kernels(serving, native=True),
                   "onnxruntime": make_engine("onnxruntime", args.model, engine_dir=args.onnx_dir,
                                              threads=args.threads)}
    else:
        exported = make_engine("onnxruntime", args.model, engine_dir=args.onnx_dir, threads=args.threads)
        engines = {"torch": make_engine("torch", args.model),
                   "torch_serving": ServingEngine(BatchedEngine(serving, chunk_threads=cpus)),
                   "torch_serving_no_kernels": ServingEngine(BatchedEngine(serving, chunk_threads=cpus), native=False),
                   "onnxruntime": exported,
                   "onnxruntime_serving": ServingEngine(OrtBatchedEngine(exported, threads=args.threads))}
    if args.trt_dir:
        engines["tensorrt"] = make_engine("tensorrt", args.model, engine_dir=args.trt_dir)
    adapters = [name for name in ADAPTERS if (args.model.parent / "adapters" / name).is_dir()]
    for engine in {id(engine.adapters): engine for engine in engines.values()}.values():  # serving's share one set
        for name in adapters:
            engine.adapters.load(name, args.model.parent / "adapters" / name)
    adapter = "coding" if "coding" in adapters else None
    config = engines["torch"].config
    history = torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    floor = Floor(weight_bytes(engines["torch"].model))
    rows = measure(engines, history, adapter, n_decode, repeats, floor)
    print(f"\nEngine speed on {args.model} ({family}, W={config.window}; {context}-token prefill, replay of W under "
          f"{adapter!r}, {n_decode} decode steps; medians with min-max over {repeats} interleaved repeats, "
          f"{args.threads} threads)\n")
    print(markdown_table(rows, COLUMNS))
    write_json(rows, args.json)
    plot(rows, args.plot, f"Engines on {args.model.parent.name}/{args.model.name} ({family})")
    return rows


if __name__ == "__main__":
    main()
