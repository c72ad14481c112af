"""Turn cost: what one short turn costs at a long context, ours (tritonserver, the demo) beside vLLM's CPU build
(a Llama of the demo's size and shape with 4 LoRA adapters; benchmarks/peer_vllm.py), both on this machine.

Contexts 512, 2K, 8K and 32K tokens (32K: 32,768 less 256 kept free for the short turns, both models' limit being
32,768). Ours: a conversation whose first turn is a prompt of that many tokens (this repository's READMEs,
repeated; counted with the demo tokenizer; max_tokens 1), then short turns (a few words, max_tokens 1, the
non-streamed `generate`), alternating `continue` (the adapter of the turn before) and `switch` (the next adapter
of chat -> agent -> coding -> design); `bytes_written` / `bytes_moved` per turn are the change of the server's
counters mol2_state_bytes_written / mol2_state_bytes_moved (summed over labels) across the turn, null when the
server has no such counter.

vLLM's completions are stateless: each turn sends the same prefix whole (the first turn, our chat markers
included, so the token ids are ours) plus a short extension (a one-word reply and the short user turn, fresh each
repeat). `continue` = the same LoRA (a0) after a warm-up request with that prefix: a prefix-cache hit. `switch` =
another LoRA (a1, a2, a3 in turn) whose cache has never seen the prefix: vLLM keys its prefix cache per adapter, so
the whole prefix is prefilled again. The first three switches are on the conversation's own prefix (each adapter
sees it for the first time); later repeats start the prefix with a distinct first line ("Conversation N."), which
no adapter has seen either, so every switch is a miss. bytes are null for vLLM.

llama.cpp (`llamacpp`, benchmarks/peer_llamacpp.py; skipped with one line when scripts/install_llamacpp.sh has not
run): llama-server's /completion is stateless too and is sent exactly what vLLM is, the adapter in the request's
`lora` field. Its prompt cache lives in the slot that served the prefix and is cleared when the slot's adapters
change, so a `switch` prefills the whole history again (and so may the `continue` after it, sent back to that slot).
`prefilled_tokens` is the median of what llama-server says it evaluated (`timings.prompt_n`: the prompt less what its
cache held); null for the others.

server_ms is client-observed on loopback (send to the complete answer), the median over the repeats. Engines are
interleaved context by context (the order reversed every other context); the load average is written beside each row.

`--demo DIR` serves another demo (as `mol2 serve --demo DIR`), e.g. models/demo-v41; every row names its model's
family (ced, deepseek_v41; the peers' rows `llama`). The peers run a Llama of the CED demo's shape and their CPU
builds do not run the deepseek_v41 layout, so with a deepseek_v41 demo they are left out, said so in one line.

    python -m benchmarks.turn_cost [--demo DIR] [--quick] [--json PATH] [--plot PATH] [--no-vllm] [--no-llamacpp]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

from . import load, peer_llamacpp
from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json
from .peer_vllm import ADAPTERS, PEER_ROOT, SKIP_MESSAGE, build_peer, running_vllm, vllm_available, vllm_name

ROOT = Path(__file__).resolve().parent.parent
CONTEXTS = (512, 2048, 8192, 32768)
QUICK_CONTEXTS = (512, 2048)
MAX_CONTEXT, RESERVE = 32768, 256
SHORT_TURNS = ["ok, and then?", "Go on.", "Say more.", "Why is that?", "And after that?", "Thanks, next.",
               "What else?", "Really?", "Explain briefly.", "One more."]
WRITTEN, MOVED = "mol2_state_bytes_written", "mol2_state_bytes_moved"
COLUMNS = ["family", "engine", "context_tokens", "kind", "server_ms", "server_ms_min", "server_ms_max", "repeats",
           "bytes_written", "bytes_moved", "prompt_tokens", "prefilled_tokens", "first_turn_ms", "load_avg"]
PEER_FAMILY = "llama"  # vLLM's and llama.cpp's model: a Llama of the CED demo's size (benchmarks/peer_vllm.py)
PEERS_SKIPPED = ("vLLM and llama.cpp left out: their CPU builds do not run the {family} layout (their rows stay on "
                 "their Llama peer: run turn_cost without --demo)")
SWITCH_TARGET = 2.0  # issue #34: another adapter's turn at 8K within 2x the same adapter's, through the server


def prompt_tokens_for(context: int) -> int:
    return min(context, MAX_CONTEXT - RESERVE)


def short_text(repeat: int, kind: str) -> str:
    return f"{SHORT_TURNS[repeat % len(SHORT_TURNS)]} ({kind} {repeat})"


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _row(engine, context, kind, seconds, written, moved, prompt_tokens, first_ms, prefilled=(),
         family=PEER_FAMILY) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {"family": family, "engine": engine, "context_tokens": context, "kind": kind,
            "server_ms": statistics.median(ms),
            "server_ms_min": min(ms), "server_ms_max": max(ms), "repeats": len(ms),
            "bytes_written": _median(written), "bytes_moved": _median(moved), "prompt_tokens": prompt_tokens,
            "prefilled_tokens": _median(prefilled), "first_turn_ms": first_ms, "load_avg": load.load_avg()}


class Counters:
    """Our server's per-turn state counters, read off its metrics port."""

    def __init__(self, metrics_base: str):
        self.base = metrics_base

    def read(self) -> tuple[float | None, float | None]:
        try:
            text = load.get_text(self.base, "/metrics")
        except (OSError, load.ServerError):
            return None, None
        return load.prometheus_sum(text, WRITTEN), load.prometheus_sum(text, MOVED)


def _delta(after, before):
    return None if after is None or before is None else after - before


def measure_ours(client: load.Mol2Client, counters: Counters, tokenizer, context: int, repeats: int,
                 family: str = "ced") -> list[dict]:
    tokens = prompt_tokens_for(context)
    text = load.text_of_tokens(tokens, tokenizer, ROOT)
    answer, first_s = client.generate(text, ADAPTERS[0], 1)
    conversation = answer["conversation_id_out"]
    current = 0
    client.generate(short_text(0, "warm-up"), ADAPTERS[current], 1, conversation_id=conversation)
    seconds = {"continue": [], "switch": []}
    written = {"continue": [], "switch": []}
    moved = {"continue": [], "switch": []}
    for repeat in range(repeats):
        for kind in ("continue", "switch"):
            if kind == "switch":
                current = (current + 1) % len(ADAPTERS)
            before = counters.read()
            _, elapsed = client.generate(short_text(repeat, kind), ADAPTERS[current], 1, conversation_id=conversation)
            after = counters.read()
            seconds[kind].append(elapsed)
            written[kind].append(_delta(after[0], before[0]))
            moved[kind].append(_delta(after[1], before[1]))
    client.generate("Bye.", ADAPTERS[current], 1, conversation_id=conversation, end_conversation=True)
    return [_row("mol2", context, kind, seconds[kind], written[kind], moved[kind], tokens, first_s * 1e3,
                 family=family) for kind in ("continue", "switch")]


def peer_prefix(tokenizer, tokens: int):
    """A peer's history of `tokens` tokens as one user turn (a lead line makes it another conversation's)."""
    return lambda lead="": load.user_turn(load.text_of_tokens(tokens, tokenizer, ROOT, lead=lead))


def peer_extension(repeat: int, kind: str) -> str:
    """A peer's short turn after the history: the assistant's reply, then the user's next question."""
    return "Sure." + load.END + load.user_turn(short_text(repeat, kind), first=False)


def measure_vllm(client: load.VllmClient, tokenizer, context: int, repeats: int, switch_repeats: int) -> list[dict]:
    prefix = peer_prefix(tokenizer, prompt_tokens_for(context))
    own = prefix()
    answer, cold_s = client.complete(own + peer_extension(0, "warm-up"), vllm_name(ADAPTERS[0]), 1)  # caches it under a0
    prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens")
    seconds = {"continue": [], "switch": []}
    for repeat in range(max(repeats, switch_repeats)):
        if repeat < repeats:
            _, elapsed = client.complete(own + peer_extension(repeat, "continue"), vllm_name(ADAPTERS[0]), 1)
            seconds["continue"].append(elapsed)
        if repeat < switch_repeats:
            target = ADAPTERS[1 + repeat % (len(ADAPTERS) - 1)]
            text = own if repeat < len(ADAPTERS) - 1 else prefix(lead=f"Conversation {repeat}.\n")
            _, elapsed = client.complete(text + peer_extension(repeat, "switch"), vllm_name(target), 1)
            seconds["switch"].append(elapsed)
    return [_row("vllm", context, kind, seconds[kind], [None], [None], prompt_tokens, cold_s * 1e3)
            for kind in ("continue", "switch")]


def measure_llamacpp(client: peer_llamacpp.LlamaCppClient, tokenizer, context: int, repeats: int,
                     switch_repeats: int) -> list[dict]:
    """vLLM's protocol (measure_vllm) on llama-server: the same prompts, our adapters by their `lora` ids."""
    prefix = peer_prefix(tokenizer, prompt_tokens_for(context))
    own = prefix()
    answer, cold_s = client.complete(own + peer_extension(0, "warm-up"), ADAPTERS[0], 1)  # cached in a slot, under a0
    prompt_tokens = answer.get("tokens_evaluated")
    seconds = {"continue": [], "switch": []}
    prefilled = {"continue": [], "switch": []}
    for repeat in range(max(repeats, switch_repeats)):
        turns = []
        if repeat < repeats:
            turns.append(("continue", own, ADAPTERS[0]))
        if repeat < switch_repeats:
            text = own if repeat < len(ADAPTERS) - 1 else prefix(lead=f"Conversation {repeat}.\n")
            turns.append(("switch", text, ADAPTERS[1 + repeat % (len(ADAPTERS) - 1)]))
        for kind, text, adapter in turns:
            answer, elapsed = client.complete(text + peer_extension(repeat, kind), adapter, 1)
            seconds[kind].append(elapsed)
            prefilled[kind].append((answer.get("timings") or {}).get("prompt_n"))
    return [_row("llamacpp", context, kind, seconds[kind], [None], [None], prompt_tokens, cold_s * 1e3,
                 prefilled[kind]) for kind in ("continue", "switch")]


def _get(rows, engine, context, kind, key="server_ms"):
    row = next((r for r in rows if r["engine"] == engine and r["context_tokens"] == context and r["kind"] == kind),
               None)
    return None if row is None else row[key]


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def ratio_lines(rows: list[dict], contexts: tuple[int, ...]) -> list[str]:
    """The target's ratios; where a context was not measured (--quick), the same ratio at the largest context
    measured, labelled as such."""
    top = max(contexts)
    big = 32768 if 32768 in contexts else top
    mid = 8192 if 8192 in contexts else top
    label = lambda c: f"{c // 1024}K" if c >= 1024 else str(c)  # noqa: E731
    lines = []
    for kind in ("continue", "switch"):
        lines.append(f"ours {kind} at {label(big)} / at 512: "
                     f"{_fmt(_ratio(_get(rows, 'mol2', big, kind), _get(rows, 'mol2', 512, kind)))}")
    switch = _ratio(_get(rows, 'mol2', mid, 'switch'), _get(rows, 'mol2', mid, 'continue'))
    verdict = "" if switch is None else f" ({'met' if switch <= SWITCH_TARGET else 'NOT met'})"
    lines.append(f"ours switch / ours continue at {label(mid)} (issue #34's target <= {SWITCH_TARGET:g}): "
                 f"{_fmt(switch)}{verdict}")
    lines.append(f"ours continue / vLLM continue at {label(mid)}: "
                 f"{_fmt(_ratio(_get(rows, 'mol2', mid, 'continue'), _get(rows, 'vllm', mid, 'continue')))}")
    lines.append(f"vLLM switch / ours switch at {label(mid)}: "
                 f"{_fmt(_ratio(_get(rows, 'vllm', mid, 'switch'), _get(rows, 'mol2', mid, 'switch')))}")
    for context in sorted({2048, mid} & set(contexts)):  # issue #36 quotes the switch on a 2K history
        lines.append(f"llama.cpp switch / ours switch at {label(context)}: "
                     f"{_fmt(_ratio(_get(rows, 'llamacpp', context, 'switch'), _get(rows, 'mol2', context, 'switch')))}"
                     f" ({_fmt(_get(rows, 'llamacpp', context, 'switch'))} ms against "
                     f"{_fmt(_get(rows, 'mol2', context, 'switch'))} ms)")
    for kind in ("continue", "switch"):
        lines.append(f"ours bytes_written ({kind}) at {label(big)} / at 512: "
                     f"{_fmt(_ratio(_get(rows, 'mol2', big, kind, 'bytes_written'), _get(rows, 'mol2', 512, kind, 'bytes_written')))}")
    if big != 32768 or mid != 8192:
        lines.append(f"(--quick: 8K and 32K not measured; the ratios above use {label(top)})")
    return lines


def plot(rows: list[dict], path: str, family: str = "ced") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    styles = {("mol2", "continue"): ("#2a7", "-"), ("mol2", "switch"): ("#2a7", "--"),
              ("vllm", "continue"): ("#c63", "-"), ("vllm", "switch"): ("#c63", "--"),
              ("llamacpp", "continue"): ("#94c", "-"), ("llamacpp", "switch"): ("#94c", "--")}
    for (engine, kind), (colour, dash) in styles.items():
        cells = sorted((r for r in rows if r["engine"] == engine and r["kind"] == kind),
                       key=lambda r: r["context_tokens"])
        if not cells:
            continue
        xs = [r["context_tokens"] for r in cells]
        left.plot(xs, [r["server_ms"] for r in cells], dash, color=colour, marker="o", label=f"{engine} {kind}")
        if engine == "mol2":
            for key, marker, shade in (("bytes_written", "o", colour), ("bytes_moved", "x", "#147")):
                if any(r[key] is not None for r in cells):
                    right.plot(xs, [(r[key] or 0) / 2**20 for r in cells], dash, color=shade, marker=marker,
                               label=f"{key.removeprefix('bytes_')}, {kind}")
    contexts = sorted({r["context_tokens"] for r in rows})
    names = [f"{c // 1024}K" if c >= 1024 else str(c) for c in contexts]
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(contexts, names)
        axis.minorticks_off()
    left.set_yscale("log")
    left.set_xlabel("context (tokens)")
    left.set_ylabel("short turn, client-observed (ms)")
    left.set_title("a short turn at a long context")
    left.legend(fontsize=7)
    right.set_xlabel("context (tokens)")
    right.set_ylabel("state per turn, ours (MiB)")
    right.set_title("state written / moved per turn")
    if right.lines:
        right.set_ylim(bottom=0)
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "the server has no\nmol2_state_bytes_* counters", ha="center", va="center",
                   transform=right.transAxes)
    peers = "" if family != "ced" else (" vs vLLM CPU (same size Llama, prefix cache per LoRA) vs llama.cpp (the same "
                                         "Llama in GGUF, cache cleared on a LoRA change)")
    figure.suptitle(f"turn cost: mol2 (tritonserver, {family} demo){peers}", fontsize=9)
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="contexts 512 and 2K, fewer repeats (a smoke check)")
    parser.add_argument("--demo", default=None, help="the demo folder to serve (default: the one every command "
                                                     "uses, ced/demo.py), e.g. models/demo-v41")
    parser.add_argument("--json", help="write the rows as JSON")
    add_plot_option(parser, "artifacts/benchmarks/turn_cost.png")
    parser.add_argument("--repeats", type=int, default=None, help="turns of each kind (default 6; --quick 3)")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--contexts", type=lambda text: tuple(int(n) for n in text.split(",")), default=None,
                        help="comma-separated context lengths (default 512,2048,8192,32768; --quick 512,2048)")
    parser.add_argument("--engine", default="torch", choices=("torch", "onnxruntime"), help="our server's engine")
    args = parser.parse_args(argv)
    contexts = args.contexts or (QUICK_CONTEXTS if args.quick else CONTEXTS)
    repeats = args.repeats or (3 if args.quick else 6)
    began = time.perf_counter()

    from tokenizers import Tokenizer

    from ced.families import family_of
    from python_backend.server.launcher import Ports
    from python_backend.server.serve_cli import prepare_demo

    model_dir = prepare_demo(args.demo)
    family = family_of(model_dir).name
    if family != "ced":
        if args.engine == "tensorrt":
            raise SystemExit(f"turn_cost: --engine tensorrt runs the ced family only; {model_dir} is {family}")
        print(PEERS_SKIPPED.format(family=family))
        args.no_vllm = args.no_llamacpp = True
        args.plot_default = args.plot_default.replace(".png", f"_{family}.png")  # the ced figure stays
    args.plot = plot_path(args)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    use_vllm = not args.no_vllm and vllm_available()
    if not args.no_vllm and not use_vllm:
        print(SKIP_MESSAGE)
    use_llamacpp = not args.no_llamacpp and peer_llamacpp.llamacpp_available()
    if not args.no_llamacpp and not use_llamacpp:
        print(peer_llamacpp.SKIP_MESSAGE)
    env = {"MOL2_ENGINE": args.engine, "MOL2_MAX_PROMPT_TOKENS": "32768"}  # the model's context: prompts up to it
    if args.engine == "onnxruntime":
        from ced.engines import ensure_onnx_engine

        env["MOL2_ENGINE_DIR"] = str(ensure_onnx_engine(model_dir))
    logs = ROOT / "artifacts/logs"
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        ports, _ = stack.enter_context(load.demo_server("turn_cost", env, demo=args.demo))
        vllm = None
        if use_vllm:
            peer = build_peer(PEER_ROOT)
            print(f"starting vLLM on the peer ({peer}); log {logs / 'vllm_turn_cost.log'}", flush=True)
            vllm = load.VllmClient(stack.enter_context(running_vllm(peer, Ports.free().http,
                                                                     logs / "vllm_turn_cost.log")))
        llamacpp = None
        if use_llamacpp:
            llamacpp = peer_llamacpp.start_client(stack, logs / "llamacpp_turn_cost.log", tokenizer,
                                                  Ports.free().http, ROOT)
        mol2 = load.Mol2Client(f"http://{ports.http_url}")
        counters = Counters(f"http://{ports.host}:{ports.metrics}")
        print(f"servers up after {time.perf_counter() - began:.0f} s", flush=True)
        mol2.generate("Hello.", ADAPTERS[0], 1, end_conversation=True)  # warm-up
        if vllm:
            for adapter in ADAPTERS:  # each LoRA loaded once before anything is timed
                vllm.complete(load.user_turn("Hello."), vllm_name(adapter), 1)
        if llamacpp:
            for adapter in ADAPTERS:
                llamacpp.complete(load.user_turn("Hello."), adapter, 1)
        for index, context in enumerate(contexts):
            order = ["mol2", "vllm", "llamacpp"] if index % 2 == 0 else ["llamacpp", "vllm", "mol2"]
            switch_repeats = 2 if context >= 32768 else repeats
            for engine in order:
                started = time.perf_counter()
                if engine == "mol2":
                    rows += measure_ours(mol2, counters, tokenizer, context, repeats, family)
                elif engine == "vllm" and vllm:
                    rows += measure_vllm(vllm, tokenizer, context, repeats, switch_repeats)
                elif engine == "llamacpp" and llamacpp:
                    rows += measure_llamacpp(llamacpp, tokenizer, context, repeats, switch_repeats)
                else:
                    continue
                done = rows[-2:]
                print(f"  {engine:8s} {context:>5d} tokens: continue {done[0]['server_ms']:.0f} ms, switch "
                      f"{done[1]['server_ms']:.0f} ms ({time.perf_counter() - started:.0f} s, load "
                      f"{done[1]['load_avg'][0]})", flush=True)
    print(f"\nshort turns (max_tokens 1, non-streamed), {repeats} repeats of each kind alternating (vLLM's and "
          f"llama.cpp's switch at 32K: 2); server_ms = client-observed on loopback, median; bytes = our counters' "
          f"change per turn (null: the server has no {WRITTEN} / {MOVED}); prefilled_tokens = llama.cpp's "
          f"timings.prompt_n; first_turn_ms = ours: the conversation's first turn, vLLM and llama.cpp: the cold "
          f"warm-up request; load average (1, 5, 15 min) beside each row\n")
    print(markdown_table(rows, COLUMNS))
    print()
    for line in ratio_lines(rows, contexts):
        print(line)
    if not use_vllm and not args.no_vllm:
        print(SKIP_MESSAGE)
    if not use_llamacpp and not args.no_llamacpp:
        print(peer_llamacpp.SKIP_MESSAGE)
    if family != "ced":
        print(PEERS_SKIPPED.format(family=family))
    print(f"\ntook {time.perf_counter() - began:.0f} s; load average now {load.load_avg()}")
    write_json(rows, args.json)
    if args.plot:  # --plot "": no figure
        plot(rows, args.plot, family)
    return rows


if __name__ == "__main__":
    main()
