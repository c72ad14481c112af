"""Replay quality: does a switch lose information? The seed's protocol ("A switch loses no information"), at demo scale.

For every source/target pair over base, the domain adapters and a random adapter on other modules: the source
processes an input and a reply token by token (forced, the same tokens for every source); a new user turn
arrives; the engine switches to the target (bounded replay) and force-decodes the same continuation. Compared
with the oracle (the whole context recomputed under the target in one pass) and with the no-switch control (the
target throughout, token by token, no replay): logit MAE, top-1 agreement, PPL ratio exp(CE_path - CE_oracle).
Then the decoder hidden states of the replay window against the oracle's at several context lengths (where the
family's engine can capture them: the ced family's; the deepseek_v41 engine has no capture, so that part is skipped).

The family comes from the demo's model/config.json (ced.families): `--demo models/demo-v41` runs the same protocol
on the DeepSeek-V4.1-layout demo, whose random_l0 also adapts the routed experts. Every row names its family.

    python -m benchmarks.replay_quality [--demo DIR] [--quick] [--json PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from ced import CEDEngine
from ced.demo import BASE_NAME, resolve_demo

from ._report import markdown_table, save_figure, write_json

COLUMNS = ["family", "target", "source", "ppl_ratio", "logit_mae", "control_logit_mae", "top1_agreement",
           "bitwise_equal_across_sources"]
TRAINED = ("chat", "agent", "coding", "design")
PPL_TARGET = (0.95, 1.05)  # issue #34: every trained target's PPL ratio against the oracle within this band
DOMAINS = ("general", "chat", "coding", "agent", "design")  # the validation stream: ~3000 tokens of each, in order


# -- the metrics ------------------------------------------------------------------------------------------

def compare(path: Tensor, oracle: Tensor, targets: Tensor) -> dict:
    """Logits (N, V) of a path and of the oracle at the positions that predict `targets` (N,)."""
    ce_path = F.cross_entropy(path.float(), targets).item()
    ce_oracle = F.cross_entropy(oracle.float(), targets).item()
    return dict(logit_mae=(path - oracle).abs().mean().item(),
                top1_agreement=(path.argmax(-1) == oracle.argmax(-1)).float().mean().item(),
                ppl_ratio=math.exp(ce_path - ce_oracle))


def shown(adapter: str | None) -> str:
    return BASE_NAME if adapter is None else adapter  # the base model, named as the server names it


# -- the three paths ---------------------------------------------------------------------------------------

def token_by_token(engine: CEDEngine, tokens: list[int], adapter: str | None):
    state = engine.new_conversation()
    engine.prefill(state, tokens[:1])
    logits, _ = engine.replay(state, adapter)
    for token in tokens[1:]:
        logits = engine.step(state, token, adapter)
    return state, logits


def force(engine: CEDEngine, state, logits: Tensor, continuation: list[int], adapter) -> Tensor:
    """Logits predicting each continuation token, feeding the true token each time: (N, V)."""
    out = [logits]
    for token in continuation[:-1]:
        out.append(engine.step(state, token, adapter))
    return torch.stack(out)


def run_pairs(engine: CEDEngine, adapters: list[str | None], history: list[int], turn: list[int],
              continuation: list[int], family: str = "ced") -> tuple[list[dict], dict]:
    targets = torch.tensor(continuation)
    sources = {}
    for source in tqdm(adapters, desc="sources: history token by token"):
        sources[source] = token_by_token(engine, history, source)[0]
    rows, curves = [], {}
    context = history + turn
    for target in tqdm(adapters, desc="targets: switch, oracle, control"):
        oracle = engine.oracle(context + continuation, target)[len(context) - 1: -1]
        control_state = copy.deepcopy(sources[target])  # the target throughout: no switch, no replay
        logits = None
        for token in turn:
            logits = engine.step(control_state, token, target)
        control = force(engine, control_state, logits, continuation, target)
        control_mae = compare(control, oracle, targets)["logit_mae"]
        paths = {}
        for source in adapters:
            state = copy.deepcopy(sources[source])
            paths[source] = force(engine, state, engine.turn(state, turn, target).logits, continuation, target)
        bitwise = all(torch.equal(paths[s], paths[adapters[0]]) for s in adapters)
        for source in adapters:
            rows.append(dict(family=family, target=shown(target), source=shown(source),
                             **compare(paths[source], oracle, targets),
                             control_logit_mae=control_mae, bitwise_equal_across_sources=bitwise))
        curves[shown(target)] = ((paths[adapters[0]] - oracle).abs().mean(-1), (control - oracle).abs().mean(-1))
    return rows, curves


def captures_hidden(engine) -> bool:
    """Whether the engine's replay and oracle can hand back each decoder layer's output (a `capture` argument)."""
    return all("capture" in inspect.signature(verb).parameters for verb in (engine.replay, engine.oracle))


def hidden_state_mae(engine: CEDEngine, tokens: list[int], adapter: str | None, context: int) -> Tensor:
    """|replay - oracle| of each decoder layer's output over the replay window: (layers, W) mean over hidden."""
    state = engine.new_conversation()
    engine.prefill(state, tokens[:context])
    replayed, oracle = {}, {}
    engine.replay(state, adapter, capture=replayed)
    engine.oracle(tokens[:context], adapter, capture=oracle)
    W = replayed[engine.config.decoder_start][0].shape[1]
    return torch.stack([(replayed[layer][0][0] - torch.cat(oracle[layer], dim=1)[0, -W:]).abs().mean(-1)
                        for layer in sorted(replayed)])


# -- inputs ------------------------------------------------------------------------------------------------

def load(args) -> tuple[CEDEngine, list[str | None], list[int], bool, str]:
    """The engine of the demo's family with its adapters, a stream of validation tokens (real text when trained),
    whether the demo is trained, and the family's name."""
    from ced.engines import make_engine
    from ced.families import family_of

    demo = resolve_demo(args.demo)
    family = family_of(demo.model_dir).name
    print(f"{demo.describe()}; family {family}")
    adapter_dirs = demo.adapters_dir
    if demo.trained:
        from engine_build.tokenizer import load_tokenizer

        names = [n for n in (*TRAINED, "random_l0") if (adapter_dirs / n).is_dir()]
        tokenizer = load_tokenizer(demo.tokenizer)
        if not (Path(args.corpus) / "general.valid.jsonl").is_file():
            raise SystemExit(f"no corpus at {args.corpus}: build it with `python -m engine_build corpus --out "
                             f"{args.corpus}` (about a minute)")
        stream = []
        for i, domain in enumerate(DOMAINS):
            with open(Path(args.corpus) / f"{domain}.valid.jsonl") as lines:
                for line in lines:
                    stream += tokenizer.encode(json.loads(line)["text"]).ids
                    if len(stream) > 3000 * (1 + i):
                        break
    elif family != "ced":
        raise SystemExit(f"{demo.root} holds an untrained {family} model (no tokenizer.json): this benchmark "
                         "measures a trained demo, e.g. models/demo-v41")
    else:
        from ced import CEDForCausalLM
        from ced.synthetic import make_random_adapter

        print("no trained demo: random tokens (run `python -m engine_build demo` first for the real measurement)")
        names = list(demo.adapters)
        if not (adapter_dirs / "random_l0").is_dir():  # PEFT wraps a plain model, before the engine wraps its own
            model = CEDForCausalLM.from_pretrained(demo.model_dir)
            make_random_adapter(model, adapter_dirs / "random_l0", decoder_modules_other(model), rank=8, alpha=32,
                                seed=99, scale=0.05)
        names.append("random_l0")
        stream = torch.randint(0, 256, (8192,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = make_engine("torch", demo.model_dir, max_adapters=8, max_rank=16)
    for name in names:
        engine.adapters.load(name, adapter_dirs / name)
    return engine, [None, *names], stream, demo.trained, family


def decoder_modules_other(model) -> str:
    from ced.synthetic import decoder_modules_regex

    return decoder_modules_regex(model.ced, ("attn.o_proj", "mlp.up_proj", "mlp.down_proj"))


# -- report ------------------------------------------------------------------------------------------------

def summarize(rows: list[dict]) -> list[dict]:
    summary = []
    for target in dict.fromkeys(r["target"] for r in rows):
        these = [r for r in rows if r["target"] == target]
        path_mae = sum(r["logit_mae"] for r in these) / len(these)
        summary.append(dict(family=these[0]["family"], target=target,
                            ppl_ratio_min=min(r["ppl_ratio"] for r in these),
                            ppl_ratio_max=max(r["ppl_ratio"] for r in these), logit_mae=path_mae,
                            control_logit_mae=these[0]["control_logit_mae"],
                            control_share=these[0]["control_logit_mae"] / path_mae if path_mae else float("nan"),
                            top1_agreement=sum(r["top1_agreement"] for r in these) / len(these),
                            bitwise_equal_across_sources=these[0]["bitwise_equal_across_sources"]))
    return summary


def shown_ratios(rows: list[dict]) -> list[dict]:
    """Rows for the markdown tables: PPL ratios to 5 decimals (the gaps sit in the 4th-5th; JSON keeps them all)."""
    return [{k: f"{v:.5f}" if k.startswith("ppl_ratio") else v for k, v in row.items()} for row in rows]


def plot(rows, curves, hidden, out: Path, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["target"] for r in rows))
    figure, axes = plt.subplots(1, 3, figsize=(18, 4.2), gridspec_kw=dict(wspace=0.45))
    for ax, key, title, fmt in ((axes[0], "ppl_ratio", "PPL ratio vs oracle", ".4f"),
                                (axes[1], "logit_mae", "logit MAE", ".1e")):
        grid = [[next(r[key] for r in rows if r["target"] == t and r["source"] == s) for s in names] for t in names]
        image = ax.imshow(grid, cmap="viridis")
        ax.set(xticks=range(len(names)), yticks=range(len(names)), xlabel="source", ylabel="target", title=title)
        ax.set_xticklabels(names, rotation=45, ha="right")
        ax.set_yticklabels(names)
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                ax.text(j, i, format(value, fmt), ha="center", va="center", color="w", fontsize=7)
        figure.colorbar(image, ax=ax, fraction=0.046)
    for target, (path, control) in curves.items():
        axes[2].plot(path.numpy(), label=f"{target}: path")
    axes[2].plot(next(iter(curves.values()))[1].numpy(), "k--", label="control (first target)")
    axes[2].set(xlabel="tokens after the switch", ylabel="logit MAE vs oracle", yscale="log",
                title="Where the error sits")
    axes[2].legend(fontsize=7)
    save_figure(figure, out / f"{stem}_pairs.png")
    if not hidden:
        return

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for context, per_layer in hidden.items():
        left.plot(per_layer.mean(0).numpy(), label=f"{context} tokens")
        right.plot(per_layer.mean(1).numpy(), "o-", label=f"{context} tokens")
    left.set(xlabel="position in the replay window", ylabel="hidden-state MAE (mean over layers)", yscale="log",
             title="Replay window vs oracle")
    right.set(xlabel="decoder layer (0 = first decoder layer)", ylabel="hidden-state MAE (mean over window)",
              title="By depth")
    left.legend()
    right.legend()
    save_figure(figure, out / f"{stem}_hidden.png")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="shorter inputs; base, two adapters and random_l0: a smoke check")
    parser.add_argument("--demo", default=None, help="a demo folder, model/ and adapters/ (default: the one every "
                                                     "command uses, ced/demo.py)")
    parser.add_argument("--corpus", default="artifacts/corpus", help="corpus with *.valid.jsonl")
    # One thread: on the 2 shared cores a token-by-token step took 11 ms on one thread and 121 ms on two while
    # other jobs ran (ced demo, 2026-12-06); these are quality numbers, so the thread count only sets the wall time.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden-samples", type=int, default=12,
                        help="text windows averaged per context length (one window's error varies ±20-30%% with its text)")
    parser.add_argument("--json", help="write the pair table as JSON rows here")
    parser.add_argument("--out", help="folder for the PNG figures and tables (default: artifacts/benchmarks; with "
                                      "--quick, artifacts/benchmarks/quick)")
    args = parser.parse_args(argv)
    out = Path(args.out or ("artifacts/benchmarks/quick" if args.quick else "artifacts/benchmarks"))

    torch.set_num_threads(args.threads)
    engine, adapters, stream, trained, family = load(args)
    sizes = (256, 64, 16, 64) if args.quick else (1024, 256, 32, 256)  # input, reply, new turn, continuation
    contexts = (320, 384) if args.quick else (640, 768, 896, 1024)
    if args.quick:
        adapters = adapters[:3] + adapters[-1:]
    n_input, n_reply, n_turn, n_cont = sizes
    history = stream[: n_input + n_reply]
    turn = stream[n_input + n_reply: n_input + n_reply + n_turn]
    continuation = stream[n_input + n_reply + n_turn: sum(sizes)]
    rows, curves = run_pairs(engine, adapters, history, turn, continuation, family)
    hidden, starts = {}, []
    if captures_hidden(engine):
        # Several windows of text per length: one window's error depends on what text sits at its start.
        starts = [i * max(contexts) for i in range(args.hidden_samples) if (i + 1) * max(contexts) <= len(stream)]
        hidden = {c: torch.stack([hidden_state_mae(engine, stream[s:], t, c) for s in starts for t in adapters]).mean(0)
                  for c in tqdm(contexts, desc="hidden states")}

    model_name = "trained demo" if trained else "UNTRAINED demo (random weights)"
    print(f"\nReplay quality on the {model_name} ({family}): input {n_input} + reply {n_reply} token by token under "
          f"the source, new turn {n_turn}, switch, continuation {n_cont} forced; W={engine.config.window}\n")
    print(markdown_table(shown_ratios(rows), COLUMNS))
    summary = summarize(rows)
    print("\nPer target (over all sources); control_share = control MAE / path MAE\n")
    print(markdown_table(shown_ratios(summary), list(summary[0])))
    trained_rows = [r for r in summary if r["target"] in TRAINED]
    if trained_rows:
        low, high = min(r["ppl_ratio_min"] for r in trained_rows), max(r["ppl_ratio_max"] for r in trained_rows)
        inside = PPL_TARGET[0] <= low and high <= PPL_TARGET[1]
        print(f"\nTrained targets' PPL ratio {low:.5f}-{high:.5f}: {'within' if inside else 'OUTSIDE'} "
              f"[{PPL_TARGET[0]}, {PPL_TARGET[1]}] of the oracle")
    tables = [shown_ratios(rows), shown_ratios(summary)]
    if hidden:
        layers = [f"layer_{engine.config.decoder_start + i}" for i in range(next(iter(hidden.values())).shape[0])]
        hidden_rows = [dict(family=family, context_tokens=c, mean=h.mean().item(),
                            first_16_positions=h[:, :16].mean().item(), last_16_positions=h[:, -16:].mean().item(),
                            **{l: v.item() for l, v in zip(layers, h.mean(1))}) for c, h in hidden.items()]
        print(f"\nDecoder hidden-state MAE of the replay window against the oracle (mean over targets and "
              f"{len(starts)} text windows)\n")
        print(markdown_table(hidden_rows, list(hidden_rows[0])))
        tables.append(hidden_rows)
    else:
        print(f"\nHidden-state part skipped for {family}: its engine's replay and oracle take no `capture`, so the "
              "decoder layers' outputs cannot be read")
    stem = "replay_quality" if family == "ced" else f"replay_quality_{family}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text("\n\n".join(markdown_table(t, list(t[0])) for t in tables) + "\n")
    write_json(rows, args.json)
    plot(rows, curves, hidden, out, stem)
    return rows


if __name__ == "__main__":
    main()
