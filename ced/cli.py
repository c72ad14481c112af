"""`mol2 chat`: a scripted multi-turn conversation that switches adapters, with the state accounting per turn.

The engine's only command; `mol2` itself (mol2_cli/) gathers every package's commands.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def chat(args: argparse.Namespace) -> None:
    from .demo import BASE_NAME, SCRIPT, resolve_demo
    from .engine import CEDEngine, SamplingParams
    from .model import CEDForCausalLM
    from .tokenization import ChatTokenizer

    demo = resolve_demo(args.demo, args.artifacts)
    print(demo.describe())
    model = CEDForCausalLM.from_pretrained(demo.model_dir)
    engine = CEDEngine(model, max_adapters=8, max_rank=16)
    for name, path in demo.adapters.items():
        engine.adapters.load(name, path)
    tokenizer, config = ChatTokenizer(demo.model_dir), engine.config
    print(f"demo model: {config.n_layers} layers (encoder 0-{config.decoder_start - 1}, decoder "
          f"{config.decoder_start}-{config.n_layers - 1}), W={config.window}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"adapters: {', '.join(demo.adapters)}")
    if not demo.trained:
        print("weights and adapters are untrained (seeded random): replies are noise; costs and bytes are real\n")

    state = engine.new_conversation()
    header = f"{'turn':>4}  {'adapter':<8} {'user':>5} {'context':>8} {'replayed':>8} {'replay ms':>9} " \
             f"{'shared bytes':>13} {'adapter-bound':>13}  reply"
    print(header)
    print("-" * len(header))
    script = SCRIPT[: args.turns] if args.turns else SCRIPT
    for number, (text, adapter) in enumerate(script, start=1):
        user = tokenizer.user_turn(tokenizer.encode(text), first=state.length == 0)
        engine.prefill(state, user)
        started = time.perf_counter()
        logits, replayed = engine.replay(state, adapter)
        replay_ms = (time.perf_counter() - started) * 1e3
        reply = list(engine.generate(state, adapter, logits, args.max_tokens,
                                     SamplingParams(temperature=args.temperature, seed=args.seed),
                                     tokenizer.stop_ids))
        sizes = state.nbytes()
        shown = tokenizer.decode(reply).encode("unicode_escape").decode()[:48]
        print(f"{number:>4}  {adapter or BASE_NAME:<8} {len(user):>5} {state.length:>8} {replayed:>8} "
              f"{replay_ms:>9.1f} {sizes['shared']:>13,} {sizes['adapter_bound']:>13,}  {shown}")
    print(f"\n{len(script)} turns, {state.length} tokens of history held once; replay never exceeded "
          f"W={config.window} positions; {engine.stats.prefilled_positions} positions prefilled in total.")


def register(commands, **options) -> None:
    p = commands.add_parser("chat", **options,
                            description="Run a scripted multi-turn conversation that switches adapters and print, "
                                        "each turn, the adapter, the positions replayed and the state bytes.")
    p.add_argument("--turns", type=int, default=0, help="how many turns of the script (default: all)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn (default 24)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--demo", type=Path, default=None,
                   help="a demo folder (model/ + adapters/), or a new folder to build an untrained demo in; default: "
                        "ARTIFACTS/demo when built, else models/demo, else the untrained demo (ced/demo.py)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="where `mol2 build demo` writes ARTIFACTS/demo (default: the project's artifacts/)")
    p.set_defaults(run=chat)
