"""Switch cost: bounded replay beside a full recompute under the target, per model family, at growing context and
adapters visited; then each family's state bytes per token.

Switch latency is the time from the switch to the first token's logits under the target: ours replays the last
W positions through the decoder (W = the family's window); the baseline recomputes the whole context under the
target. State bytes are what the conversation holds after visiting N adapters. Weights are random and seeded
(cost does not depend on what the weights learned), each switch of ours timed right beside the baseline's.
`replay_positions` is counted at every switch (the positions the decoder ran), not assumed; `replay_indexer_ms` is
the median time of the replay spent in the decoder's indexers (a reindex layer scores only the entries of layer E's
candidate blocks for each replayed position, so it is bounded by the pool, not the context).

- `ced`: the `demo` shape (W=128); the baseline is every-layer LoRA (a full prefill under the target, one full
  state per adapter visited), as before this table had a `family` column.
- `deepseek_v41`: `v41-bench`, the `v41-tiny` preset (every role of the release's layout at 4+4 layers) with the
  release's window W=128 instead of tiny's 8 and rope tables made for 32K (`V41_BENCH`); random PEFT adapters on
  the native names the placement rule allows (routed experts included). The baseline recomputes the whole
  context under the target (what an engine whose prefix cache is keyed by adapter does after a switch), in
  chunks of 256 as `DeepseekV41ForCausalLM.forward`, keeping one full state (every layer's window, every
  source's global KV) per adapter visited. `replay_ms` times the family's reference path (V41Conversation, torch);
  `served_replay_ms` the same switch on the engine the server runs (V41Engine: its prefill chunks and replay one
  native call each, ced/kernels/v41.cpp), timed beside the other two (empty for ced, whose `replay_ms` is CEDEngine's).

The state table after the main one: bytes per token that grow with the context (global KV + indexer keys,
amortised over each source's compress ratio) and the fixed bytes (windows, layer E's replay inputs) of each
family at the engine's dtypes. `measured` rows count the tensors of a real conversation (prefilled, replayed) at
1K and 4K tokens and subtract; `computed` rows apply `v41_state_bytes` to a config (the same formula reproduces
the measured v41 rows exactly: tests/v41/test_v41_switch_cost.py). The `deepseek-v4.1-flash` rows are computed:
at bf16 (this engine's layout) and in the release's layout (FP4 global latent and indexer key, FP8 windows) beside
the tech report's 890 B/token.

`--demo DIR` measures a trained demo instead (its family read from DIR/model, ced.families): the demo's own
weights, rank-16 random adapters on the decoder for the ced family (the baseline's every-layer ones beside them,
as above), the demo's trained adapters (random_l0 too) for deepseek_v41; adapters visited stop at what it has.
Its state table holds the demo's measured bytes beside the CED demo's (models/demo, measured), the demo's dims in
the release's layout (computed) and the flash rows.
Without `--demo` the seeded random shapes above run (`--family`), as the tables in benchmarks/README.md were made.

    python -m benchmarks.switch_cost [--family ced|deepseek_v41|all | --demo DIR] [--quick] [--json PATH]
                                     [--plot PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ced import CEDConfig, CEDEngine, CEDForCausalLM
from ced.baseline import BaselineConversation, EveryLayerBaseline
from ced.synthetic import ATTENTION, FFN, decoder_modules_regex, make_random_adapter

from ._report import add_plot_option, markdown_table, median_spread, plot_path, save_figure, write_json

FAMILIES = ("ced", "deepseek_v41")
COLUMNS = ["family", "context_tokens", "adapters_visited", "replay_positions", "replay_ms", "replay_ms_min",
           "replay_ms_max", "replay_indexer_ms", "served_replay_ms", "served_replay_ms_min", "served_replay_ms_max",
           "baseline_ms", "baseline_ms_min", "baseline_ms_max", "latency_ratio", "state_bytes", "baseline_state_bytes",
           "bytes_ratio"]
STATE_COLUMNS = ["family", "shape", "dtype", "how", "state_bytes_per_token", "fixed_state_bytes",
                 "tech_report_bytes_per_token"]
TECH_REPORT_BYTES_PER_TOKEN = 890  # V4.1's global KV at FP4 (tech report; ../shared/reference/deepseek_v41.md §1.1, §1.4)
V41_BENCH = dict(sliding_window=128, max_position_embeddings=32768)  # v41-bench = v41-tiny with these
BASELINE = {"ced": "every-layer LoRA: full prefill", "deepseek_v41": "full recompute under the target"}
THREADS = {"ced": 2, "deepseek_v41": 1}  # default torch threads per family (--threads)
STATE_LENGTHS = (1024, 4096)  # a measured row's two conversation lengths


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


class IndexerClock:
    """Time spent in a model's indexers (`scores` / `select` / `select_in_pool` of every layer's `indexer`) since the
    last reset: the part of a replay that scores global entries."""

    def __init__(self, model):
        self.ms = 0.0
        for module in model.modules():
            indexer = getattr(module, "indexer", None)
            for name in ("scores", "select", "select_in_pool"):
                if indexer is not None and hasattr(indexer, name):
                    setattr(indexer, name, self._wrap(getattr(indexer, name)))

    def _wrap(self, method):
        def timed_method(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.ms += (time.perf_counter() - start) * 1e3
        return timed_method


def history_tokens(vocab_size: int, context: int) -> list[int]:
    return torch.randint(0, vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside a state object (dataclasses, dicts, lists, Selections); token lists and other
    plain values count nothing."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if callable(getattr(obj, "tensors", None)):  # the deepseek_v41 family's windows, stores, shared state
        return sum(tensor_bytes(t) for t in obj.tensors())
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if dataclasses.is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def growth(bytes_at: dict[int, int]) -> tuple[float, float]:
    """(bytes per token, fixed bytes) from a state's tensor bytes at two lengths {length: bytes}."""
    short, long = sorted(bytes_at)
    per_token = (bytes_at[long] - bytes_at[short]) / (long - short)
    return whole(per_token), whole(bytes_at[short] - per_token * short)


def whole(x: float) -> float | int:
    """An int where the value is whole (bytes print as bytes), else the float."""
    return int(x) if float(x).is_integer() else x


# -- the ced family -----------------------------------------------------------------------------------------------

class CedBench:
    """The demo shape: CEDEngine (bounded replay) beside EveryLayerBaseline (a full prefill under the target)."""

    family = "ced"

    def __init__(self, contexts: list[int], n_adapters: int, rank: int, workdir: Path, demo=None):
        """The `demo` preset at seeded random weights, or a trained `demo`'s own weights (ced.demo.Demo)."""
        if demo is None:
            self.config = CEDConfig.from_name("demo", max_context=max(max(contexts), *STATE_LENGTHS))
            self.shape, self.weights = "demo", lambda: CEDForCausalLM.from_ced(self.config, seed=0)
        else:
            self.config = CEDForCausalLM.from_pretrained(demo.model_dir).ced
            self.shape, self.weights = demo.root.name, lambda: CEDForCausalLM.from_pretrained(demo.model_dir)
        self.window = self.config.window
        self.engine, self.baseline, self.names = self.build(self.config, self.weights, n_adapters, rank, workdir)
        self.indexers = IndexerClock(self.engine.model)

    @staticmethod
    def build(config: CEDConfig, weights, n_adapters: int, rank: int, workdir: Path):
        plain = weights()  # PEFT wraps plain Linears: make adapters before the engines
        every_layer = r"model\.layers\.\d+\.(" + "|".join(m.replace(".", r"\.") for m in ATTENTION + FFN) + ")"
        decoder_only = decoder_modules_regex(config, ATTENTION + FFN)
        names = [f"adapter{i}" for i in range(n_adapters)]
        paths = {}
        for i, name in enumerate(tqdm(names, desc="ced adapters (PEFT)", leave=False)):
            paths[name] = (make_random_adapter(plain, workdir / f"dec{i}", decoder_only, rank, seed=i),
                           make_random_adapter(plain, workdir / f"all{i}", every_layer, rank, seed=i))
        engine, baseline = CEDEngine(weights(), n_adapters, rank), EveryLayerBaseline(weights(), n_adapters, rank)
        for name, (ours, theirs) in paths.items():
            engine.adapters.load(name, ours)
            baseline.adapters.load(name, theirs)
        return engine, baseline, names

    def conversation(self, tokens: list[int]):
        state = self.engine.new_conversation()
        self.engine.prefill(state, tokens)  # the history, written once by the adapter-free stage
        self.engine.replay(state, None)  # warm-up
        return state

    def history(self, context: int):
        tokens = history_tokens(self.config.vocab_size, context)
        return self.conversation(tokens), BaselineConversation(tokens)

    def ours(self, history, name) -> int:
        self.indexers.ms = 0.0
        logits, replayed = self.engine.replay(history[0], name)
        logits.argmax()
        return replayed

    def theirs(self, history, name) -> None:
        self.baseline.switch(history[1], name).argmax()

    def state_bytes(self, history) -> tuple[int, int]:
        return sum(history[0].nbytes().values()), history[1].nbytes()

    def state_rows(self) -> list[dict]:
        return [ced_state_row(self.engine, self.shape)]


def ced_state_row(engine: CEDEngine, shape: str) -> dict:
    """A ced engine's measured state bytes: real conversations (prefilled, replayed) at two lengths, subtracted."""
    def conversation(n: int):
        state = engine.new_conversation()
        engine.prefill(state, history_tokens(engine.config.vocab_size, n))
        engine.replay(state, None)
        return state

    per_token, fixed = growth({n: tensor_bytes(conversation(n)) for n in STATE_LENGTHS})
    return dict(family="ced", shape=shape, dtype=engine.config.dtype, how="measured (1K/4K conversation)",
                state_bytes_per_token=per_token, fixed_state_bytes=fixed, tech_report_bytes_per_token="")


def ced_demo_state_row() -> dict:
    """The CED demo's (models/demo, or whichever ced.demo finds) measured state bytes, for another family's table."""
    from ced.demo import resolve_demo

    demo = resolve_demo(None)
    return ced_state_row(CEDEngine(CEDForCausalLM.from_pretrained(demo.model_dir), 1, 16), demo.root.name)


# -- the deepseek_v41 family --------------------------------------------------------------------------------------

def v41_bench_config(max_context: int = 32768):
    from ced.deepseek_v41.config import V41Config

    return V41Config.from_name("v41-tiny", **{**V41_BENCH, "max_position_embeddings": max(
        V41_BENCH["max_position_embeddings"], max_context)})


def v41_state_bytes(config, layout: str = "engine") -> tuple[float, int]:
    """(bytes per token, fixed bytes) of one V4.1 conversation, computed from the config alone.

    layout "engine": this engine's state (ced/deepseek_v41/state.py) at the config's dtype: per KV source one
    D-wide latent and one I-wide indexer key per complete group of `ratio` positions; fixed: every layer's window
    of W latents, layer E's post-attention streams (W, hc, C) and pre-mix (W, hc) in fp32, its top-k and candidate
    pool for W positions (int64 index + bool validity each), at a length every ratio divides (no pending inputs).
    layout "release-fp4": the release's layouts (vLLM `nvfp4_ds_mla` rows, reference §1.4): latent FP4 e2m1 with
    one e4m3 scale per 16 (D/2 + D/16: 288 B at D=512), indexer key FP4 with one ue8m0 scale per 32 (I/2 + I/32:
    68 B at I=128), windows FP8 with one ue8m0 scale per 32 (D + D/32: 528 B); the replay inputs as the engine's
    at the config's dtype."""
    D, I, W, L = config.head_dim, config.index_head_dim, config.sliding_window, config.num_hidden_layers
    b = torch.empty((), dtype=config.torch_dtype).element_size()
    if layout == "engine":
        entry, window_row = (D + I) * b, D * b
    elif layout == "release-fp4":
        entry, window_row = D // 2 + D // 16 + I // 2 + I // 32, D + D // 32
    else:
        raise ValueError(f"unknown layout {layout!r}")
    per_token = whole(sum(entry / config.compress_ratios[s] for s in config.kv_source_layer_ids))
    replay_inputs = W * config.hc_mult * (config.hidden_size * b + 4)  # streams + fp32 pre-mix
    replay_inputs += W * (8 + 1) * (config.index_topk + config.candidate_topk_blocks)  # top-k + pool
    return per_token, L * W * window_row + replay_inputs


def random_v41_adapter(path: Path, modules: dict, rank: int, seed: int, scale: float = 0.1) -> str:
    """A PEFT adapter with random non-zero A and B on every module the placement rule allows (native names)."""
    from ced.adapters import write_peft_adapter

    g = torch.Generator().manual_seed(seed)
    weights = {name: (torch.randn(rank, m.in_features, generator=g) * scale,
                      torch.randn(m.out_features, rank, generator=g) * scale) for name, m in modules.items()}
    return str(write_peft_adapter(path, weights, r=rank, lora_alpha=2 * rank, base_model="v41-bench"))


@dataclasses.dataclass
class V41FullStates:
    """The baseline's conversation: the tokens and one full state per adapter visited."""

    tokens: list[int]
    states: dict = dataclasses.field(default_factory=dict)  # adapter -> (windows of every layer, every store)

    def nbytes(self) -> int:
        return tensor_bytes(self.states) + 8 * len(self.tokens)


class V41Bench:
    """v41-bench: V41Conversation (prefill, bounded replay of W) beside a full recompute under the target."""

    family = "deepseek_v41"

    def __init__(self, contexts: list[int], n_adapters: int, rank: int, workdir: Path, chunk: int = 256,
                 config=None, demo=None):
        """v41-bench at seeded random weights with random adapters, or a trained `demo` (ced.demo.Demo) with its
        own weights and adapters (at most `n_adapters` of them)."""
        from ced.deepseek_v41.adapters import V41AdapterSet
        from ced.deepseek_v41.checkpoint import load_checkpoint
        from ced.deepseek_v41.model import DeepseekV41ForCausalLM

        if demo is None:
            self.config = config or v41_bench_config(max(contexts))
            self.shape, self.model = "v41-bench", DeepseekV41ForCausalLM.from_config(self.config, seed=0)
        else:
            self.config, self.model = load_checkpoint(demo.model_dir)
            self.shape = demo.root.name
        self.window, self.chunk = self.config.sliding_window, chunk
        self.adapters = V41AdapterSet(self.model)
        if demo is None:
            self.names = [f"adapter{i}" for i in range(n_adapters)]
            paths = [random_v41_adapter(workdir / f"v41_{i}", self.adapters.modules, rank, seed=i)
                     for i in range(n_adapters)]
        else:
            folders = [*demo.adapters.values(), demo.adapters_dir / "random_l0"]
            paths = [f for f in folders if (f / "adapter_config.json").is_file()][:n_adapters]
            self.names = [f.name for f in paths]
        for name, path in zip(tqdm(self.names, desc="v41 adapters (PEFT)", leave=False), paths):
            self.adapters.load(name, path)
        self.adapters.use(None)
        self.decoded = 0  # positions run through the decoder stage since the last reset (counted, not assumed)
        run_decoder = self.model.run_decoder

        def counting(out, *args, **kwargs):
            self.decoded += out.stream.shape[1]
            return run_decoder(out, *args, **kwargs)

        self.model.run_decoder = counting
        self.indexers = IndexerClock(self.model)
        # The server's engine (V41Engine: native prefill chunks and replay) on its own copy of the same weights and
        # adapters: the reference path above wraps this model's modules itself.
        from ced.deepseek_v41.engine import V41Engine

        served = DeepseekV41ForCausalLM.from_config(self.config, seed=0) if demo is None else \
            load_checkpoint(demo.model_dir)[1]
        self.engine = V41Engine(served, max_adapters=max(len(self.names), 1), max_rank=rank)
        for name, path in zip(self.names, paths):
            self.engine.adapters.load(name, path)

    def conversation(self, tokens: list[int]):
        self.adapters.use(None)
        return v41_conversation(self.model, tokens, self.chunk)

    def history(self, context: int):
        tokens = history_tokens(self.config.vocab_size, context)
        served = self.engine.new_conversation()
        self.engine.prefill(served, tokens)
        return self.conversation(tokens), V41FullStates(tokens), served

    def ours(self, history, name) -> int:
        self.decoded, self.indexers.ms = 0, 0.0
        self.adapters.use(name)
        history[0].replay(name).argmax()
        return self.decoded

    def served(self, history, name) -> None:
        """The same switch on the server's engine (one native call, ced/kernels/v41.cpp's v41_run)."""
        logits, replayed = self.engine.replay(history[2], name)
        logits.argmax()
        if replayed != min(self.window, history[2].length):
            raise RuntimeError(f"the engine replayed {replayed} positions, not W")

    @torch.no_grad()
    def recompute(self, states: V41FullStates, name) -> torch.Tensor:
        """The whole context under `name` from empty state, chunk by chunk; the last position's logits (V,)."""
        self.adapters.use(name)
        model, tokens = self.model, states.tokens
        windows, stores = model.new_windows(range(self.config.num_hidden_layers)), model.new_stores()
        for start in range(0, len(tokens), self.chunk):
            ids = torch.tensor([tokens[start: start + self.chunk]])
            out = model.run_shared(ids, start, windows, stores)
            hidden = model.run_decoder(out, start, windows, stores, last_only=start + self.chunk >= len(tokens))
        states.states[name] = (windows, stores)
        return model.logits(hidden)[0, -1]

    def theirs(self, history, name) -> None:
        self.recompute(history[1], name).argmax()

    def state_bytes(self, history) -> tuple[int, int]:
        conversation = history[0]
        return conversation.shared.nbytes() + conversation.bound.nbytes(), history[1].nbytes()

    def state_rows(self) -> list[dict]:
        from ced.deepseek_v41.config import V41Config
        from ced.deepseek_v41.model import DeepseekV41ForCausalLM

        rows = []
        self.adapters.use(None)
        tiny = V41Config.from_name("v41-tiny")  # the preset itself (W=8), no adapters: state does not depend on them
        models = [(self.shape, self.model)] if self.shape != "v41-bench" else \
            [("v41-tiny", DeepseekV41ForCausalLM.from_config(tiny, seed=0)), ("v41-bench", self.model)]
        for shape, model in models:
            per_token, fixed = v41_measured_state(model, self.chunk)
            rows.append(dict(family=self.family, shape=shape, dtype=model.config.dtype,
                             how="measured (1K/4K conversation)", state_bytes_per_token=per_token,
                             fixed_state_bytes=fixed, tech_report_bytes_per_token=""))
        flash = V41Config.from_name("deepseek-v4.1-flash")
        computed = [("deepseek-v4.1-flash", flash, "engine"), ("deepseek-v4.1-flash", flash, "release-fp4")]
        if self.shape != "v41-bench":  # a demo: its own dims in the release's layout, beside the flash rows
            computed.insert(0, (self.shape, self.config, "release-fp4"))
        for shape, config, layout in computed:
            per_token, fixed = v41_state_bytes(config, layout)
            dtype = config.dtype if layout == "engine" else "fp4 global KV, fp8 windows"
            rows.append(dict(family=self.family, shape=shape, dtype=dtype,
                             how=f"computed ({layout} layout)", state_bytes_per_token=per_token,
                             fixed_state_bytes=fixed,
                             tech_report_bytes_per_token=TECH_REPORT_BYTES_PER_TOKEN
                             if shape == "deepseek-v4.1-flash" and layout != "engine" else ""))
        return rows


def v41_conversation(model, tokens: list[int], chunk: int = 256):
    """A V41Conversation over `tokens`: the adapter-free stage in chunks (as ced's prefill), then a replay under
    whatever adapter the model has in use (the warm-up; it fills the adapter-bound windows)."""
    from ced.deepseek_v41.conversation import V41Conversation

    conversation = V41Conversation(model)
    for start in range(0, len(tokens), chunk):
        conversation.prefill(tokens[start: start + chunk])
    conversation.replay(None)
    return conversation


def v41_measured_state(model, chunk: int = 256, lengths=STATE_LENGTHS) -> tuple[float, float]:
    """(bytes per token, fixed bytes) of real conversations' caches (every tensor counted) at two lengths."""
    at = {}
    for n in lengths:
        conversation = v41_conversation(model, history_tokens(model.config.vocab_size, n), chunk)
        at[n] = tensor_bytes(conversation.shared) + tensor_bytes(conversation.bound)
    return growth(at)


# -- the measurement ----------------------------------------------------------------------------------------------

def measure(bench, contexts: list[int], visits: list[int], repeats: int) -> list[dict]:
    """Every context's conversation is built first; then each visit switches every context in turn, ours right
    beside the baseline's, so drift of the machine spreads over all rows instead of skewing one."""
    histories = {}
    for context in tqdm(contexts, desc=f"{bench.family}: prefilling the histories"):
        histories[context] = bench.history(context)
    ours_ms = {c: [] for c in contexts}
    served_ms = {c: [] for c in contexts}  # the server's engine, where the bench has one (deepseek_v41)
    indexer_ms = {c: [] for c in contexts}
    baseline_ms = {c: [] for c in contexts}
    positions = {c: set() for c in contexts}
    bytes_after = {c: {} for c in contexts}
    for visit, name in enumerate(tqdm(bench.names[: max(visits)], desc=f"{bench.family}: adapters visited"), start=1):
        for context in contexts:
            history = histories[context]
            extra = repeats if visit == 1 and context <= 8192 else 1  # a 32K full prefill is slow enough alone
            for _ in range(extra):
                ms, replayed = timed(lambda: bench.ours(history, name))
                ours_ms[context].append(ms)
                indexer_ms[context].append(bench.indexers.ms)
                positions[context].add(replayed)
                baseline_ms[context].append(timed(lambda: bench.theirs(history, name))[0])
                if hasattr(bench, "served"):
                    served_ms[context].append(timed(lambda: bench.served(history, name))[0])
            if visit in visits:
                bytes_after[context][visit] = bench.state_bytes(history)
    rows = []
    for context in contexts:
        (ours_med, ours_lo, ours_hi) = median_spread(ours_ms[context])
        (base_med, base_lo, base_hi) = median_spread(baseline_ms[context])
        replayed = max(positions[context]) if len(positions[context]) == 1 else sorted(positions[context])
        served = median_spread(served_ms[context]) if served_ms[context] else ("", "", "")
        for visit in visits:
            ours_bytes, base_bytes = bytes_after[context][visit]
            rows.append(dict(family=bench.family, context_tokens=context, adapters_visited=visit,
                             replay_positions=replayed, replay_ms=ours_med, replay_ms_min=ours_lo,
                             replay_ms_max=ours_hi, replay_indexer_ms=median_spread(indexer_ms[context])[0],
                             served_replay_ms=served[0], served_replay_ms_min=served[1],
                             served_replay_ms_max=served[2],
                             baseline_ms=base_med, baseline_ms_min=base_lo,
                             baseline_ms_max=base_hi, latency_ratio=ours_med / base_med, state_bytes=ours_bytes,
                             baseline_state_bytes=base_bytes, bytes_ratio=ours_bytes / base_bytes))
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for family, colour in zip(FAMILIES, ("tab:blue", "tab:orange")):
        these = [r for r in rows if r["family"] == family]
        if not these:
            continue
        first = [r for r in these if r["adapters_visited"] == these[0]["adapters_visited"]]
        contexts = [r["context_tokens"] for r in first]
        for key, style, label in (("replay_ms", "-o", "bounded replay (ours)"),
                                  ("baseline_ms", "--s", BASELINE[family])):
            left.errorbar(contexts, [r[key] for r in first], fmt=style, color=colour, label=f"{family}: {label}",
                          yerr=[[r[key] - r[key + "_min"] for r in first], [r[key + "_max"] - r[key] for r in first]])
        left.plot(contexts, [r["replay_ms"] - r["replay_indexer_ms"] for r in first], ":^", color=colour,
                  label=f"{family}: bounded replay less its indexer time")
        if all(r["served_replay_ms"] != "" for r in first):
            left.errorbar(contexts, [r["served_replay_ms"] for r in first], fmt="-.D", color=colour,
                          label=f"{family}: bounded replay, the server's engine",
                          yerr=[[r["served_replay_ms"] - r["served_replay_ms_min"] for r in first],
                                [r["served_replay_ms_max"] - r["served_replay_ms"] for r in first]])
        longest = [r for r in these if r["context_tokens"] == max(contexts)]
        visited = [r["adapters_visited"] for r in longest]
        right.plot(visited, [r["baseline_state_bytes"] / 2**20 for r in longest], "--s", color=colour,
                   label=f"{family}: baseline, {max(contexts)}")
        right.plot(visited, [r["state_bytes"] / 2**20 for r in longest], "-o", color=colour,
                   label=f"{family}: ours, {max(contexts)}")
    left.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="switch → first token (ms, median, min–max)",
             title="Switch latency")
    left.legend(fontsize=7)
    right.set(xscale="log", yscale="log", xlabel="adapters visited", ylabel="conversation state (MiB)",
              title="State bytes at the longest context")
    visited = sorted({r["adapters_visited"] for r in rows})
    right.set_xticks(visited, [str(v) for v in visited])
    right.minorticks_off()
    right.legend(fontsize=7)
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all",
                        help="seeded random shapes of these families (default: %(default)s)")
    parser.add_argument("--demo", help="a trained demo folder instead (models/demo, models/demo-v41): its family, "
                                       "weights and adapters")
    parser.add_argument("--quick", action="store_true", help="512 and 2K tokens, 4 adapters: a smoke check")
    parser.add_argument("--contexts", type=int, nargs="+", help="context lengths (default 512 2048 8192 32768)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timings of the first visit, at contexts up to 8K (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch threads (default: ced 2, as its earlier results; "
                                                    "deepseek_v41 1: its tiny matrices gain nothing from a second "
                                                    "thread, and on a loaded machine the second costs it 2.5x)")
    parser.add_argument("--json", help="write the tables as JSON rows here (switch rows, then state rows)")
    add_plot_option(parser, "artifacts/benchmarks/switch_cost.png")
    args = parser.parse_args(argv)
    demo = None
    if args.demo:
        from ced.demo import resolve_demo
        from ced.families import family_of

        demo = resolve_demo(args.demo)
        print(demo.describe())
        families = (family_of(demo.model_dir).name,)
        args.plot_default = args.plot_default.replace(".png", f"_{demo.root.name}.png")  # beside the shapes' figure
    else:
        families = FAMILIES if args.family == "all" else (args.family,)
    args.plot = plot_path(args)

    contexts = args.contexts or ([512, 2048] if args.quick else [512, 2048, 8192, 32768])
    visits = [1, 2, 4] if args.quick else [1, 2, 4, 8]
    rows, state_rows, shapes = [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        for family in families:
            cls = CedBench if family == "ced" else V41Bench
            torch.set_num_threads(args.threads or THREADS[family])
            bench = cls(contexts, max(visits), 16, Path(workdir) / family, demo=demo)
            if len(bench.names) < max(visits):  # a demo has the adapters it was built with
                print(f"{bench.shape} has {len(bench.names)} adapters: adapters visited up to that")
                visits = [v for v in visits if v <= len(bench.names)]
            rows += measure(bench, contexts, visits, args.repeats)
            state_rows += bench.state_rows()
            if demo is not None and family != "ced":
                state_rows.insert(1, ced_demo_state_row())  # the CED demo's bytes beside this demo's
            shapes.append(f"{family} on {bench.shape} (W={bench.window}, {torch.get_num_threads()} threads)")
    print(f"\nSwitch cost: {', '.join(shapes)}; ms are medians with min-max over {args.repeats + max(visits) - 1} "
          f"interleaved switches ({max(visits)} above 8K); replay_positions counted per switch; bytes after N "
          "adapters visited\n")
    print(markdown_table(rows, COLUMNS))
    print("\nState bytes per token (grows with the context: global KV + indexer keys, amortised over each source's "
          "ratio) and fixed state bytes (windows, replay inputs). measured = tensors of a real conversation's cache at "
          "1K and 4K tokens, subtracted; computed = from the config (v41_state_bytes)\n")
    print(markdown_table(state_rows, STATE_COLUMNS))
    write_json([{"table": "switch", **r} for r in rows] + [{"table": "state_bytes", **r} for r in state_rows],
               args.json)
    if args.plot:
        plot(rows, args.plot)
    for family in families:
        flat = [r["replay_ms"] for r in rows if r["family"] == family and r["adapters_visited"] == 1
                and r["context_tokens"] <= 8192]
        if len(flat) > 1:
            print(f"{family}: bounded replay max/min over contexts up to 8K: {max(flat) / min(flat):.2f}")
        replay = {r["context_tokens"]: r["replay_ms"] for r in rows if r["family"] == family
                  and r["adapters_visited"] == 1}
        served = {r["context_tokens"]: r["served_replay_ms"] for r in rows if r["family"] == family
                  and r["adapters_visited"] == 1 and r["served_replay_ms"] != ""}
        for path, times in (("reference path", replay), ("server's engine", served)):
            if 512 in times and 32768 in times:
                ratio = times[32768] / times[512]
                print(f"{family}: replay at 32K / replay at 512, {path}: {ratio:.2f} (issue #34's target <= 1.5: "
                      f"{'met' if ratio <= 1.5 else 'NOT met'})")
    return rows


if __name__ == "__main__":
    main()
