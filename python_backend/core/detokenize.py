"""Token ids -> the text they add, statelessly, so a process that only relays a decoupled decode (the disaggregated
relay, python_backend/triton/front.py) can follow it; the engine's stub uses it too.

A byte-level token may end in the middle of a UTF-8 character: the text of the ids so far then ends in U+FFFD
until the next token completes it. Each decode response carries the newest ids after a few earlier ones (`PREFIX`,
enough to hold the start of any partial character), how many of them are new, and whether it is the last: the
delta is the text with the new ids minus the text without them, a partial character held back until complete.
Concatenated over a turn the deltas are the text of all its ids.
"""

from __future__ import annotations

from typing import Callable

PREFIX = 8  # earlier ids sent along: a UTF-8 character is at most 4 bytes
HELD = "\ufffd"


def window(ids: list[int], fresh: int) -> list[int]:
    """What a decode response carries for its `fresh` newest ids."""
    return ids[max(0, len(ids) - fresh - PREFIX):]


def check_ids(ids: list[int], vocab_size: int, name: str = "_ids") -> list[int]:
    """Ids an internal input carries (a client may send them to the model directly): refused unless each is a
    token of the model."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name} holds {bad}, not a token id (0 to {vocab_size - 1})")
    return ids


def text_delta(decode: Callable[[list[int]], str], ids: list[int], fresh: int, last: bool) -> str:
    if not 0 <= fresh <= len(ids):
        raise ValueError(f"_fresh is {fresh} but only {len(ids)} ids were sent")
    before = decode(ids[:len(ids) - fresh]).rstrip(HELD) if fresh < len(ids) else ""
    now = decode(ids)
    if not last:
        now = now.rstrip(HELD)  # a character the next token finishes
    return now[len(before):]
