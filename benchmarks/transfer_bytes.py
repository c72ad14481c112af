"""Bytes on the wire per turn between a disaggregated pair: the full transfer beside the delta transfer.

In process, through the code the servers run (python_backend/core/delta_transfer.py's RelayTransfers and
DecodeTransfers, the real conversation store and engine): a conversation whose first turn is a prompt of N tokens
(the history; its answer of --answer tokens), then short turns (--turn tokens in, --answer tokens out, under no
adapter). For each short turn: the bytes the relay sends decode (`to_decode`) and decode sends back
(`to_prefill`), as a delta, beside what the full transfer (transfer.encode_state) of the same states would have
sent. The model is the demo preset's shape with seeded random weights: byte counts depend on shapes only.

    python -m benchmarks.transfer_bytes [--contexts 512 8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from ced import CEDConfig, CEDEngine, CEDForCausalLM
from python_backend.core.delta_transfer import DecodeTransfers, RelayTransfers
from python_backend.core.store import ConversationStore
from python_backend.core.transfer import encode_state

from ._report import markdown_table, write_json

COLUMNS = ["history_tokens", "turn", "to_decode_full", "to_decode_delta", "to_prefill_full", "to_prefill_delta",
           "kinds"]


def one_turn(engine, relay, decode, prefill_store, store, conversation_id, tokens, answer, new):
    """A turn as the pair runs it; returns (full to decode, sent, full back, returned, kinds)."""
    state = engine.new_conversation() if new else prefill_store.load(conversation_id)
    engine.prefill(state, tokens)
    full = encode_state(state, engine.config)
    sent = relay.outgoing(conversation_id, full)
    received = decode.receive(conversation_id, sent.data)
    logits, _ = engine.replay(received.state, None)
    for _ in engine.generate(received.state, None, logits, answer):  # no stop token: exactly `answer` tokens
        pass
    returned = decode.reply(conversation_id, received, received.state, False)
    final, version = relay.incoming(sent, returned)
    store.save(conversation_id, final)
    relay.remember(conversation_id, version, final)
    back = "delta" if version else "full"
    return len(full), len(sent.data), len(encode_state(received.state, engine.config)), len(returned), \
        f"{sent.kind}/{back}"


def measure(engine, history: int, turns: int, turn_tokens: int, answer: int) -> list[dict]:
    generator = torch.Generator().manual_seed(history)
    vocab = engine.config.vocab_size
    rows = []
    with tempfile.TemporaryDirectory() as root:
        store, prefill_store = ConversationStore(root, engine.config), ConversationStore(root, engine.config)
        relay, decode = RelayTransfers(store, engine.config), DecodeTransfers(engine.config)
        for turn in range(turns + 1):
            size = history if turn == 0 else turn_tokens
            tokens = torch.randint(1, vocab, (size,), generator=generator).tolist()
            full, sent, back, returned, kinds = one_turn(engine, relay, decode, prefill_store, store, "c", tokens,
                                                         answer, new=turn == 0)
            rows.append({"history_tokens": history, "turn": turn, "to_decode_full": full, "to_decode_delta": sent,
                         "to_prefill_full": back, "to_prefill_delta": returned, "kinds": kinds})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--turns", type=int, default=3, help="short turns after the history")
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    engine = CEDEngine(CEDForCausalLM.from_ced(CEDConfig.from_name(args.preset), seed=0))
    rows = [row for history in args.contexts
            for row in measure(engine, history, args.turns, args.turn_tokens, args.answer)]
    print(markdown_table(rows, COLUMNS))
    short = [row for row in rows if row["turn"] > 0]
    for history in args.contexts:
        mine = [row for row in short if row["history_tokens"] == history]
        full = statistics.median(row["to_decode_full"] + row["to_prefill_full"] for row in mine)
        delta = statistics.median(row["to_decode_delta"] + row["to_prefill_delta"] for row in mine)
        print(f"history {history}: bytes per short turn, both ways (median): full {full:,.0f}, delta {delta:,.0f}")
    write_json(rows, args.json)


if __name__ == "__main__":
    main()
