"""Router decision time: MoL2 beside Contextual MoL and MoL, measured interleaved on the same inputs.

For each sample (a user turn of a given length, prefilled as in any turn, untimed), the three routers decide one
after another, in an order that rotates from sample to sample, so machine drift hits all three alike (the seed
measured one mode after another and warns about exactly that). Decision time only: MoL2 reads the turn's H19 and
the cached options; Contextual MoL runs the options through the encoder after the query on a copy of the state;
MoL decodes a label and a reason under the L0 adapter on a copy. p50/p95 per input-length bucket.

    python -m benchmarks.router_latency [--quick] [--json PATH] [--plot PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json

BUCKETS = [(1, 64), (65, 256), (257, 1024), (1025, 4096)]
ROUTERS = ["mol2", "contextual", "mol"]
COLUMNS = ["router", "bucket", "samples", "p50_ms", "p95_ms", "mean_ms", "p50_vs_mol2"]


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo}-{hi}"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def corpus_tokens(tokenizer, artifacts: Path, limit: int = 20000) -> list[int]:
    """A long stream of real text tokens (the held-out domain benchmark's queries, then corpus valid text)."""
    import json

    texts = []
    bench, corpus = artifacts / "router" / "data" / "domain.bench.jsonl", artifacts / "corpus"
    if bench.exists():
        texts += [json.loads(line)["query"] for line in bench.open()]
    for domain in ("chat", "agent", "coding", "design", "general"):
        path = corpus / f"{domain}.valid.jsonl"
        if path.exists():
            texts += [json.loads(line)["text"] for _, line in zip(range(40), path.open())]
    random.Random(0).shuffle(texts)
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t + "\n")
        if len(ids) >= limit:
            break
    return ids


def build_routers(engine, demo, tokenizer, candidates, mol_tokens: int):
    from mol2_router import ContextualRouter, MoL2Router, MoLRouter, PointerHead, QKHead, RouterConfig
    from mol2_router.pipeline import load_head, run_dir

    config = RouterConfig.from_name("demo")
    notes = []
    mol2_dir = run_dir(demo, "mol2", "B", 0) / "last"
    if (mol2_dir / "head.safetensors").exists():
        head, config, _ = load_head(mol2_dir)
        notes.append(f"MoL2 head: {mol2_dir}")
    else:
        torch.manual_seed(0)
        head = PointerHead(config).eval()
        notes.append("MoL2 head: untrained demo-preset head (decision time does not depend on the weights)")
    ctx_dir = run_dir(demo, "contextual", "B", 0) / "last"
    if (ctx_dir / "head.safetensors").exists():
        qk, _, _ = load_head(ctx_dir)
        notes.append(f"Contextual q/k head: {ctx_dir}")
    else:
        qk = QKHead(config.hidden_size, config.d_model).eval()
        notes.append("Contextual q/k head: untrained (decision time does not depend on the weights)")
    routers = (MoL2Router(head, engine.model.get_input_embeddings().weight, tokenizer, candidates),
               ContextualRouter(engine, qk, tokenizer, candidates, config.max_option_tokens),
               MoLRouter(engine, tokenizer, candidates, adapter="random_l0", max_tokens=mol_tokens))
    return {router.name: router for router in routers}, notes  # options prepared here, untimed


def measure(engine, routers, options, stream: list[int], per_bucket: int, seed: int) -> list[dict]:
    """One timed decision per router per sample, as a served turn makes (a repeated decision on the same H19 would
    find the head warm in the CPU caches: measured, repeats 2-5 took about half the first one's time)."""
    from mol2_router import RouteQuery
    from mol2_router.features import ASSISTANT, BOS, END, USER

    rng = random.Random(seed)
    samples = []
    for lo, hi in BUCKETS:
        for _ in range(per_bucket):
            n = int(round(math.exp(rng.uniform(math.log(max(lo, 8)), math.log(hi)))))
            start = rng.randrange(0, len(stream) - n)
            body = stream[start: start + n - 4]
            samples.append(((lo, hi), [BOS, USER] + body + [END, ASSISTANT]))
    rng.shuffle(samples)  # buckets interleaved too
    # warm-up: first calls pay allocations and lazy initialisation
    state = engine.new_conversation()
    query = RouteQuery(engine.prefill(state, samples[0][1][:32]), state)
    for name, router in routers.items():
        for _ in range(3 if name == "mol2" else 1):  # MoL2's call is short enough for its first ones to stand out
            router.decide(query, options)
    records = []
    for i, (bucket, tokens) in enumerate(tqdm(samples, desc="samples (3 routers each)")):
        state = engine.new_conversation()
        query = RouteQuery(engine.prefill(state, tokens)[1:], state)  # the turn's H19 (after <|bos|>), untimed
        order = ROUTERS[i % 3:] + ROUTERS[: i % 3]
        for name in order:
            started = time.perf_counter()
            routers[name].decide(query, options)
            records.append({"router": name, "bucket": bucket, "tokens": len(tokens),
                            "ms": (time.perf_counter() - started) * 1e3})
    return records


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for lo, hi in BUCKETS + [(1, 4096)]:
        p50_mol2 = None
        for name in ROUTERS:
            ms = [r["ms"] for r in records if r["router"] == name and (lo, hi) in (r["bucket"], (1, 4096))]
            if not ms:
                continue
            p50 = statistics.median(ms)
            p50_mol2 = p50 if name == "mol2" else p50_mol2
            rows.append({"router": name, "bucket": "all" if (lo, hi) == (1, 4096) else bucket_name(lo, hi),
                         "samples": len(ms), "p50_ms": p50, "p95_ms": percentile(ms, 0.95),
                         "mean_ms": statistics.fmean(ms), "p50_vs_mol2": p50 / p50_mol2 if p50_mol2 else float("nan")})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = [bucket_name(lo, hi) for lo, hi in BUCKETS]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.27
    for k, name in enumerate(ROUTERS):
        p50 = [next((r["p50_ms"] for r in rows if r["router"] == name and r["bucket"] == b), float("nan")) for b in buckets]
        p95 = [next((r["p95_ms"] for r in rows if r["router"] == name and r["bucket"] == b), float("nan")) for b in buckets]
        xs = [i + (k - 1) * width for i in range(len(buckets))]
        ax.bar(xs, p50, width, label=f"{name} p50")
        ax.scatter(xs, p95, marker="_", color="black", s=200, zorder=3, label="p95" if k == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(buckets)), [f"{b} tokens" for b in buckets])
    ax.set_ylabel("decision time (ms, log)")
    ax.axhline(3.0, color="grey", linestyle="--", linewidth=1)
    ax.text(len(buckets) - 0.5, 3.3, "3 ms", color="grey", ha="right")
    ax.set_title("Routing decision time per input length (interleaved, same inputs)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one sample per bucket, short MoL decode (1-2 min)")
    parser.add_argument("--samples-per-bucket", type=int, default=8)
    parser.add_argument("--mol-tokens", type=int, default=64, help="MoL's label + reason budget (seed: 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--demo", default=None, help="a demo folder (default: the one every command uses, ced/demo.py)")
    parser.add_argument("--artifacts", default=None,
                        help="where `mol2 build demo` writes ARTIFACTS/demo, and its corpus (default: artifacts/)")
    parser.add_argument("--json", default=None, help="write the table rows as JSON")
    add_plot_option(parser, "artifacts/benchmarks/router_latency.png")
    args = parser.parse_args(argv)
    args.plot = plot_path(args)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.samples_per_bucket, args.mol_tokens = 1, min(args.mol_tokens, 16)

    from ced.demo import WORK_ROOT, resolve_demo
    from mol2_router.builders import adapter_candidates
    from mol2_router.features import RouteTokenizer
    from mol2_router.pipeline import demo_engine

    demo = resolve_demo(args.demo, args.artifacts)
    print(demo.describe())
    engine = demo_engine(demo, args.artifacts)
    tokenizer = RouteTokenizer(demo.tokenizer)
    options = adapter_candidates(demo.adapters_dir)
    routers, notes = build_routers(engine, demo, tokenizer, options, args.mol_tokens)
    stream = corpus_tokens(tokenizer, Path(args.artifacts or WORK_ROOT))
    records = measure(engine, routers, options, stream, args.samples_per_bucket, args.seed)
    rows = summarize(records)
    print(f"\n{demo.describe()}; threads={args.threads}; MoL decodes up to {args.mol_tokens} tokens under random_l0")
    for note in notes:
        print(note)
    print(markdown_table(rows, COLUMNS))
    write_json(rows, args.json)
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
