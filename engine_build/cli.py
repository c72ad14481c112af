"""`mol2 build` (or `python -m engine_build`): the demo model's build steps and its engines.

    python -m engine_build corpus    --out DIR                              the offline text corpus
    python -m engine_build tokenizer --corpus DIR --out DIR                 the BPE tokenizer
    python -m engine_build pretrain  --corpus DIR --tokenizer DIR --out DIR  the base model (resumable)
    python -m engine_build adapters  --corpus DIR --model DIR --out DIR      the PEFT adapters and their table
    python -m engine_build demo      [--root artifacts]                     all four into artifacts/demo, skipping
                                                                            the steps already done
    python -m engine_build onnx      --model DIR --out DIR                  either family's stages as ONNX + engine.json
    python -m engine_build tensorrt  --onnx DIR --out DIR --precision fp16  those graphs as TensorRT plans (GPU)
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import time
from pathlib import Path

from . import corpus as C


def _cmd_corpus(args: argparse.Namespace) -> int:
    t0 = time.time()
    apt_lists = args.apt_lists
    if apt_lists is None and not args.no_prepare:
        apt_lists = C.prepare_system(Path(args.apt_dir))
    config = C.CorpusConfig(
        man_root=None if args.man_root == "none" else args.man_root,
        fortune_root=None if args.fortune_root == "none" else args.fortune_root,
        stdlib_root=None if args.stdlib_root == "none" else (args.stdlib_root or C._default_stdlib()),
        design_roots=tuple(args.design_root or C.CorpusConfig().design_roots),
        apt_lists=apt_lists or Path("/var/lib/apt/lists"),
        valid_fraction=args.valid_fraction,
        seed=args.seed,
    )
    if args.scale != 1.0:
        config.caps = {k: int(v * args.scale) for k, v in config.caps.items()}
    manifest = C.build_corpus(args.out, config, progress=not args.quiet)
    print(f"{'source':<11} {'domain':<8} {'status':<8} {'files':>7} {'docs':>8} {'MB':>8}  {'MB before cap':>13}")
    for name, s in manifest["sources"].items():
        print(f"{name:<11} {s['domain']:<8} {s['status']:<8} {s['files_scanned']:>7} {s['documents']:>8} "
              f"{s['bytes'] / C.MB:>8.2f}  {s['bytes_before_cap'] / C.MB:>13.2f}  {s['reason']}")
    print(f"{'domain':<8} {'train docs':>10} {'train MB':>9} {'valid docs':>10} {'valid MB':>9}")
    for d, v in manifest["domains"].items():
        print(f"{d:<8} {v['train']['documents']:>10} {v['train']['bytes'] / C.MB:>9.2f} "
              f"{v['valid']['documents']:>10} {v['valid']['bytes'] / C.MB:>9.2f}")
    print(f"total {manifest['totals']['documents']} documents, {manifest['totals']['bytes'] / C.MB:.1f} MB "
          f"in {time.time() - t0:.0f} s -> {args.out}")
    return 0


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    from . import tokenizer as T

    t0 = time.time()
    tok = T.train_tokenizer(args.corpus, args.out, vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                            progress=not args.quiet)
    print(f"trained vocab {tok.get_vocab_size()} in {time.time() - t0:.0f} s -> {Path(args.out) / 'tokenizer.json'}")
    if not args.no_stats:
        stats = T.corpus_stats(tok, args.corpus, progress=not args.quiet)
        (Path(args.out) / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        print(f"{'domain':<8} {'split':<6} {'docs':>8} {'chars':>12} {'tokens':>11} {'chars/token':>11}")
        for row in stats["rows"]:
            print(f"{row['domain']:<8} {row['split']:<6} {row['documents']:>8} {row['chars']:>12} "
                  f"{row['tokens']:>11} {row['chars_per_token']:>11.2f}")
    return 0


def _pretrain_config(args: argparse.Namespace):
    from .train_config import PretrainConfig

    return PretrainConfig(preset=args.preset, tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size,
                          lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed, eval_every=args.eval_every,
                          ckpt_every=args.ckpt_every, valid_rows=args.valid_rows, bf16=not args.fp32,
                          chunk_size=args.chunk_size)


def _cmd_pretrain(args: argparse.Namespace) -> int:
    import torch

    from .pretrain import pretrain

    torch.set_num_threads(args.threads)
    summary = pretrain(_pretrain_config(args), args.corpus, args.tokenizer, args.out, progress=not args.quiet,
                       keep_work=args.keep_work, stop_after=args.stop_after)
    if not summary["finished"]:
        print(f"stopped at step {summary['step']}; run the same command again to resume")
        return 0
    minutes = summary["train_seconds"] / 60
    print(f"{summary['steps']} steps, {summary['tokens_seen']:,} tokens seen in {minutes:.1f} min "
          f"({summary['tokens_per_second']:.0f} tokens/s); final train loss {summary['final_train_loss']:.4f}, "
          f"valid loss {summary['final_valid_loss']:.4f} -> {Path(args.out) / 'model'}")
    return 0


def _adapter_config(args: argparse.Namespace):
    from .train_config import AdapterTrainConfig

    return AdapterTrainConfig(rank=args.rank, alpha=args.alpha, lr=args.adapter_lr, steps=args.steps,
                              batch_size=args.adapter_batch_size, valid_rows=args.adapter_valid_rows,
                              seed=args.seed, every_layer_domain=args.every_layer_domain,
                              max_doc_tokens=args.max_doc_tokens)


def _cmd_adapters(args: argparse.Namespace) -> int:
    import torch

    from .adapters import train_adapters

    torch.set_num_threads(args.threads)
    rows = train_adapters(args.corpus, args.model, args.out, _adapter_config(args), progress=not args.quiet)
    worse = [r["name"] for r in rows if r["lower_than_base"] is False]
    print(f"-> {args.out} (adapters.md, adapters.json)" + (f"; NOT better than the base: {worse}" if worse else ""))
    return 0


def _add_adapter_options(p: argparse.ArgumentParser) -> None:
    from .train_config import AdapterTrainConfig

    d = AdapterTrainConfig
    p.add_argument("--rank", type=int, default=d.rank, help="LoRA rank (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=d.alpha, help="LoRA alpha (default: %(default)s)")
    p.add_argument("--adapter-lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="steps per adapter (default: %(default)s)")
    p.add_argument("--adapter-batch-size", type=int, default=d.batch_size, help="rows per step (default: %(default)s)")
    p.add_argument("--adapter-valid-rows", type=int, default=d.valid_rows,
                   help="most validation rows per domain (default: %(default)s)")
    p.add_argument("--max-doc-tokens", type=int, default=d.max_doc_tokens,
                   help="one random window of at most this many tokens per document (default: %(default)s)")
    p.add_argument("--every-layer-domain", default=d.every_layer_domain,
                   help="data of the every-layer adapter (default: %(default)s)")


def _cmd_demo(args: argparse.Namespace) -> int:
    """corpus -> tokenizer -> pretrain -> adapters under --root, each step skipped when its output exists."""
    import torch

    from .adapters import train_adapters
    from .pretrain import pretrain

    torch.set_num_threads(args.threads)
    root = Path(args.root)
    corpus, tokenizer, demo = root / "corpus", root / "tokenizer", root / "demo"
    quiet = ["--quiet"] if args.quiet else []
    if args.family == "deepseek_v41":
        return _demo_v41(args, root, corpus, quiet)
    if args.quick:
        raise ValueError("--quick sizes the deepseek_v41 demo only (add --family deepseek_v41)")
    steps = [
        ("corpus", corpus / "manifest.json",
         lambda: main(["corpus", "--out", str(corpus), "--apt-dir", str(root / "apt")] + quiet)),
        ("tokenizer", tokenizer / "tokenizer.json",
         lambda: main(["tokenizer", "--corpus", str(corpus), "--out", str(tokenizer)] + quiet)),
        ("pretrain", demo / "pretrain" / "summary.json",
         lambda: pretrain(_pretrain_config(args), corpus, tokenizer, demo, progress=not args.quiet,
                          keep_work=args.keep_work, stop_after=args.stop_after)),
        ("adapters", demo / "adapters" / "adapters.json",
         lambda: train_adapters(corpus, demo / "model", demo / "adapters", _adapter_config(args),
                                progress=not args.quiet)),
    ]
    for name, done, run in steps:
        if done.exists():
            print(f"[demo] {name}: already built ({done})")
            continue
        print(f"[demo] {name}: building (first run only; cached in {done.parent})")
        result = run()
        if isinstance(result, dict) and result.get("finished") is False:  # --stop-after: a checkpoint, not a model
            print(f"[demo] {name}: stopped at step {result['step']} with a checkpoint; run the same command again "
                  "to resume")
            return 0
    manifest = write_demo_manifest(demo, args)
    print(f"[demo] ready: {demo} ({manifest['total_mb']:.1f} MB of model + adapters); see {demo / 'README.md'}")
    return 0


def _demo_v41(args: argparse.Namespace, root: Path, corpus: Path, quiet: list[str]) -> int:
    """The deepseek_v41 demo (engine_build/v41_demo.py): the corpus stage as above, then its own stages."""
    from .v41_demo import build_v41_demo

    if not (corpus / "manifest.json").exists():
        print(f"[demo-v41] corpus: building (first run only; cached in {corpus})")
        main(["corpus", "--out", str(corpus), "--apt-dir", str(root / "apt")] + quiet)
    build_v41_demo(root, quick=args.quick, progress=not args.quiet, threads=args.threads)
    return 0


def write_demo_manifest(demo: Path, args: argparse.Namespace | None = None) -> dict:
    """manifest.json and README.md in `demo`: the commands, the training numbers, the adapter table, file sizes."""
    import hashlib

    summary = json.loads((demo / "pretrain" / "summary.json").read_text())
    adapters = json.loads((demo / "adapters" / "adapters.json").read_text())
    files = {}
    for path in sorted((demo / "model").glob("*")) + sorted((demo / "adapters").glob("*/*")):
        if path.is_file():
            files[str(path.relative_to(demo))] = {"bytes": path.stat().st_size,
                                                  "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    total = sum(f["bytes"] for f in files.values()) / C.MB
    pre = {k: v for k, v in summary.items() if k != "history"}
    commands = [
        "python -m engine_build corpus --out artifacts/corpus",
        "python -m engine_build tokenizer --corpus artifacts/corpus --out artifacts/tokenizer",
        "python -m engine_build pretrain --corpus artifacts/corpus --tokenizer artifacts/tokenizer --out artifacts/demo",
        "python -m engine_build adapters --corpus artifacts/corpus --model artifacts/demo/model "
        "--out artifacts/demo/adapters",
        "# or all four, skipping finished steps: python -m engine_build demo --root artifacts",
    ]
    manifest = {"commands": commands, "pretrain": pre, "valid_history": summary["history"]["valid"],
                "adapters": adapters, "files": files, "total_mb": total}
    (demo / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    cfg = pre["config"]
    lines = [
        "# The demo CED model and its adapters", "",
        "Built offline on CPU from `artifacts/corpus` (Debian descriptions, man pages, the Python standard library, "
        "fortunes, UI files) with the 8192-token BPE in `artifacts/tokenizer`.", "",
        "```bash", *commands, "```", "",
        "## Pretraining", "",
        f"Preset `{cfg['preset']}`, {pre['parameters'] / 1e6:.2f}M parameters; {pre['steps']} steps x "
        f"{cfg['batch_size']} rows x {cfg['seq_len']} tokens = **{pre['tokens_seen']:,} tokens seen** in "
        f"{pre['train_seconds'] / 60:.1f} min of training ({pre['tokens_per_second']:.0f} tokens/s); "
        f"mixture {cfg['weights']}; AdamW lr {cfg['lr']} (warmup {cfg['warmup_steps']}, cosine to "
        f"{cfg['min_lr_ratio']}x), bf16 autocast {cfg['bf16']}, seed {cfg['seed']}.", "",
        f"Final train loss (mean of the last {cfg['eval_every']} steps) **{pre['final_train_loss']:.4f}**, "
        f"validation loss **{pre['final_valid_loss']:.4f}** nats/token (the run's fixed validation mixture: "
        f"{cfg['valid_rows']} rows of the validation split, bf16 autocast {cfg['bf16']}; the adapter table below "
        "scores its own rows in float32, so its base numbers differ).", "",
        "| step | tokens | valid loss | " + " | ".join(pre["final_valid_per_domain"]) + " |",
        "|---|---|---|" + "---|" * len(pre["final_valid_per_domain"]),
    ]
    for v in summary["history"]["valid"]:
        lines.append(f"| {v['step']} | {v['tokens']:,} | {v['loss']:.4f} | "
                     + " | ".join(f"{v['per_domain'][d]:.3f}" for d in pre["final_valid_per_domain"]) + " |")
    lines += ["", "![loss curves](pretrain/loss_curve.png)", "", "## Adapters", "",
              (demo / "adapters" / "adapters.md").read_text().split("\n\n", 1)[-1].strip(), "",
              f"## Files ({total:.1f} MB in model/ and adapters/)", "",
              "| file | bytes | sha256 |", "|---|---|---|"]
    lines += [f"| {name} | {f['bytes']:,} | `{f['sha256'][:16]}` |" for name, f in files.items()]
    (demo / "README.md").write_text("\n".join(lines) + "\n")
    return manifest


def _doc(module: str) -> str | None:
    """A module's docstring, read without importing it (the training and export modules load torch)."""
    return ast.get_docstring(ast.parse(Path(importlib.util.find_spec(module).origin).read_text()))


def _add_pretrain_options(p: argparse.ArgumentParser) -> None:
    from .train_config import PretrainConfig

    d = PretrainConfig
    p.add_argument("--preset", default=d.preset, help="CED preset (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="training tokens (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per packed row (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="rows per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="weights, rows and order (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validations (default: %(default)s)")
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="steps between checkpoints (default: %(default)s)")
    p.add_argument("--valid-rows", type=int, default=d.valid_rows, help="validation rows (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="queries per forward chunk (default: %(default)s)")
    p.add_argument("--fp32", action="store_true", help="no bfloat16 autocast")
    p.add_argument("--keep-work", action="store_true", help="keep the packed rows and the last checkpoint")
    p.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after N steps this session")


def _cmd_publish(args: argparse.Namespace) -> int:
    from .publish import publish

    summary = publish(args.src, args.dst)
    print(f"published {args.src} -> {args.dst}: {summary['total_bytes'] / 2**20:.1f} MiB")
    return 0


def _cmd_onnx(args: argparse.Namespace) -> int:
    import torch

    from ced.families import family_of
    from ced.onnx_export import OPSET

    torch.set_num_threads(args.threads)
    t0 = time.time()
    manifest = family_of(args.model).export_onnx(args.model, args.out, opset=args.opset or OPSET,
                                                 exporter=args.exporter)  # the ced family's or deepseek_v41's
    print(f"exported {len(manifest['graphs'])} graphs (opset {manifest['opset']}, config "
          f"{manifest['config_fingerprint']}, weights {manifest['weights_fingerprint']}, "
          f"{len(manifest['lora_modules'])} LoRA modules) in {time.time() - t0:.1f} s -> {args.out}")
    return 0


def _cmd_tensorrt(args: argparse.Namespace) -> int:
    from ced.tensorrt_build import build_engines

    try:
        build_engines(args.onnx, args.out, args.precision, args.max_tokens, args.max_adapters, args.max_rank)
    except RuntimeError as error:
        print(f"tensorrt: {error}", file=sys.stderr)
        return 2
    return 0


def _vocab_size(text: str) -> int:
    from .tokenizer import MAX_VOCAB, MIN_VOCAB

    if not text.isdigit() or not MIN_VOCAB <= int(text) <= MAX_VOCAB:
        raise argparse.ArgumentTypeError(f"{text!r} is not a vocabulary size in {MIN_VOCAB}..{MAX_VOCAB}")
    return int(text)


def _cmd_synthetic_v41(args: argparse.Namespace) -> int:
    """A DeepSeek-V4.1 checkpoint in the release's format (ced/deepseek_v41/checkpoint.py): random weights under
    the native names, the release's storage dtypes (FP8 with UE8M0 scales, FP4 experts packed in I8, F32, BF16),
    several shards and the index; `mol2 inspect DIR` loads it and runs one forward."""
    import torch
    from tqdm import tqdm

    from ced.deepseek_v41.checkpoint import expected_shapes, write_synthetic
    from ced.deepseek_v41.config import V41Config

    torch.set_num_threads(args.threads)
    config = V41Config.from_name(args.preset)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ValueError(f"{out} is not empty (--force writes over it)")
    with tqdm(total=len(expected_shapes(config)), unit="tensor", desc=f"synthetic {args.preset}") as bar:
        summary = write_synthetic(out, config, seed=args.seed, max_shard_bytes=int(args.shard_mb * 2**20),
                                  progress=bar.update)
    print(f"{summary.parameters:,} parameters as {summary.tensors} tensors in {summary.shards} shards, "
          f"{summary.payload_bytes:,} bytes ({summary.bytes_per_parameter:.3f} bytes/parameter) -> {out}")
    return 0


DESCRIPTION = ("Build the demo model (corpus, tokenizer, pretraining, adapters) and its engines (ONNX, TensorRT), or "
               "a synthetic DeepSeek-V4.1 checkpoint in the release's format.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The build commands, on `python -m engine_build`'s own parser or on `mol2 build`'s."""
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("corpus", help="build the offline text corpus (per-domain train/valid JSONL + manifest.json)",
                       description=C.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--out", required=True, help="output folder")
    c.add_argument("--man-root", default=str(C.CorpusConfig.man_root), help="man page folder, or 'none' (default: %(default)s)")
    c.add_argument("--fortune-root", default=str(C.CorpusConfig.fortune_root), help="fortune folder, or 'none' (default: %(default)s)")
    c.add_argument("--stdlib-root", default=None, help="Python standard library folder, or 'none' (default: the running interpreter's)")
    c.add_argument("--design-root", action="append", help="folder searched for CSS/SVG/HTML/.ui/.glade; repeatable (default: /usr/share)")
    c.add_argument("--apt-lists", default=None, type=Path,
                   help="folder with apt's *_Packages* and *_i18n_Translation-en* files (default: fetched into --apt-dir when root, else /var/lib/apt/lists)")
    c.add_argument("--apt-dir", default="artifacts/apt", help="where the private apt lists go (default: %(default)s)")
    c.add_argument("--no-prepare", action="store_true",
                   help="do not run apt-get (no private 'apt-get update' with English descriptions, no fortunes install)")
    c.add_argument("--valid-fraction", type=float, default=0.02, help="share of documents for validation (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0, help="salt of every hash-based choice (default: %(default)s)")
    c.add_argument("--scale", type=float, default=1.0, help="multiply every per-source byte cap (default: %(default)s)")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(fn=_cmd_corpus)

    t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on a built corpus",
                       description="Train a byte-level BPE (tokenizers) on the corpus's train split; writes "
                                   "tokenizer.json, tokenizer_config.json and stats.json (tokens per domain).")
    t.add_argument("--corpus", required=True, help="folder written by the corpus command")
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--vocab-size", type=_vocab_size, default=8192,
                   help="vocabulary size, 8192..16384 (default: %(default)s, the demo preset's; pretrain sizes the "
                        "model's embedding to the tokenizer)")
    t.add_argument("--min-frequency", type=int, default=2, help="least count of a merged pair (default: %(default)s)")
    t.add_argument("--no-stats", action="store_true", help="skip counting tokens per domain")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(fn=_cmd_tokenizer)

    r = sub.add_parser("pretrain", help="pretrain a CED preset on the corpus (resumable)",
                       description=_doc("engine_build.pretrain"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--corpus", default="artifacts/corpus", help="corpus folder (default: %(default)s)")
    r.add_argument("--tokenizer", default="artifacts/tokenizer", help="tokenizer folder (default: %(default)s)")
    r.add_argument("--out", default="artifacts/demo", help="writes OUT/model and OUT/pretrain (default: %(default)s)")
    r.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_pretrain_options(r)
    r.set_defaults(fn=_cmd_pretrain)

    a = sub.add_parser("adapters", help="train the domain adapters with PEFT and print base vs adapter losses",
                       description=_doc("engine_build.adapters"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--corpus", default="artifacts/corpus", help="corpus folder (default: %(default)s)")
    a.add_argument("--model", default="artifacts/demo/model", help="pretrained model folder (default: %(default)s)")
    a.add_argument("--out", default="artifacts/demo/adapters", help="output folder (default: %(default)s)")
    a.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    a.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    a.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_adapter_options(a)
    a.set_defaults(fn=_cmd_adapters)

    m = sub.add_parser("demo", help="build everything the demo needs into ROOT/demo (skips finished steps)",
                       description="Run corpus -> tokenizer -> pretrain -> adapters into ROOT/corpus, ROOT/tokenizer "
                                   "and ROOT/demo, skipping every step whose output is already there, then write "
                                   "ROOT/demo/manifest.json and README.md (commands, numbers, sizes).")
    m.add_argument("--root", default="artifacts", help="artifacts folder (default: %(default)s)")
    m.add_argument("--family", choices=("ced", "deepseek_v41"), default="ced",
                   help="ced: the CED demo into ROOT/demo; deepseek_v41: the V4.1-layout demo into ROOT/demo-v41 "
                        "(pretrain, storage table and release-format model, adapters; its router head is then "
                        "`mol2 router demo-v41`; its settings are "
                        "engine_build/v41_demo.py's FULL, the pretrain and adapter options below are the CED demo's) "
                        "(default: %(default)s)")
    m.add_argument("--quick", action="store_true",
                   help="with --family deepseek_v41: a few-minute build at the v41-tiny size into ROOT/demo-v41-quick")
    m.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    m.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_pretrain_options(m)
    _add_adapter_options(m)
    m.set_defaults(fn=_cmd_demo)

    u = sub.add_parser("publish", help="copy a built demo into models/demo with bf16 weights (what is committed)")
    u.add_argument("--src", type=Path, default=Path("artifacts/demo"), help="the built demo (default artifacts/demo)")
    u.add_argument("--dst", type=Path, default=Path("models/demo"), help="where to publish (default models/demo)")
    u.set_defaults(fn=_cmd_publish)

    o = sub.add_parser("onnx", help="export the stages (prefill, replay, decode_step) of a ced or deepseek_v41 "
                       "model as ONNX graphs",
                       description=_doc("ced.onnx_export"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("--model", type=Path, default=Path("models/demo/model"), help="model folder (default: %(default)s)")
    o.add_argument("--out", type=Path, required=True, help="output folder (graphs + engine.json)")
    o.add_argument("--opset", type=int, default=None, help="ONNX opset (default: ced/onnx_export.py's OPSET, 18)")
    o.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript",
                   help="torch.onnx path: torchscript traces in seconds, dynamo takes minutes (default: %(default)s)")
    o.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    o.set_defaults(fn=_cmd_onnx)

    g = sub.add_parser("tensorrt", help="build TensorRT plans from the ONNX graphs (needs tensorrt and a GPU)",
                       description=_doc("ced.tensorrt_build"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--onnx", type=Path, required=True, help="folder written by the onnx command")
    g.add_argument("--out", type=Path, required=True, help="output folder (plans + engine.json)")
    g.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16", help="(default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=256, help="longest prefill chunk (default: %(default)s)")
    g.add_argument("--max-adapters", type=int, default=8, help="adapter slots (default: %(default)s)")
    g.add_argument("--max-rank", type=int, default=16, help="largest LoRA rank (default: %(default)s)")
    g.set_defaults(fn=_cmd_tensorrt)

    v = sub.add_parser("synthetic-v41", help="write a random DeepSeek-V4.1 checkpoint in the release's format",
                       description=_cmd_synthetic_v41.__doc__)
    v.add_argument("--out", required=True, help="the model directory to write")
    v.add_argument("--preset", default="v41-tiny", help="a V4.1 preset (default: %(default)s)")
    v.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    v.add_argument("--shard-mb", type=float, default=0.25,
                   help="largest shard in MiB (default: %(default)s, several shards at the tiny size)")
    v.add_argument("--force", action="store_true", help="write into a non-empty directory")
    v.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    v.set_defaults(fn=_cmd_synthetic_v41)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine_build", description=DESCRIPTION)
    add_arguments(p)
    return p


# input folders the commands read: what each must hold, and the command that builds it
INPUTS = {"corpus": ("*.train.jsonl", "python -m engine_build corpus --out DIR"),
          "tokenizer": ("tokenizer.json", "python -m engine_build tokenizer --corpus DIR --out DIR"),
          "model": ("config.json", "python -m engine_build pretrain --out DIR (the model is DIR/model)")}


def _missing_input(args: argparse.Namespace) -> str | None:
    for name, (pattern, command) in INPUTS.items():
        folder = getattr(args, name, None)
        if folder is not None and not any(Path(folder).glob(pattern)):
            return f"--{name} {folder} holds no {pattern}: build it with `{command}`"
    return None


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    problem = _missing_input(args)
    if problem:  # before any work: a wrong folder would otherwise train on nothing or fail deep inside
        parser.error(problem)
    try:
        return args.fn(args)
    except (OSError, ValueError) as error:  # a missing, unreadable or too-small input: its message, no traceback
        raise SystemExit(f"{parser.prog} {args.command}: error: {error}") from None


def register(commands, **options) -> None:
    """`mol2 build ...`."""
    p = commands.add_parser("build", **options, description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(run=lambda args: run(p, args))


def main(argv: list[str] | None = None) -> int:
    """`python -m engine_build ...`: `mol2 build ...` under its old name."""
    parser = build_parser()
    return run(parser, parser.parse_args(argv))
