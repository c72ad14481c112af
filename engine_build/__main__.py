"""Command line: `python -m engine_build corpus --out DIR` and `python -m engine_build tokenizer --corpus DIR --out DIR`."""
from __future__ import annotations

import argparse
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine_build", description="Build the demo model's corpus and tokenizer.")
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
    t.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size, 8192..16384 (default: %(default)s)")
    t.add_argument("--min-frequency", type=int, default=2, help="least count of a merged pair (default: %(default)s)")
    t.add_argument("--no-stats", action="store_true", help="skip counting tokens per domain")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(fn=_cmd_tokenizer)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
