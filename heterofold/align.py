"""Token alignment (TA) by character end offsets, index pairing (the ablation), and layer alignment (LA)."""
from __future__ import annotations

import bisect
import math

import numpy as np


def token_alignment(sender_ends, receiver_ends) -> np.ndarray:
    """For each receiver token j, the sender token i(j) whose state it takes.

    A receiver token whose end offset is also a sender token's end takes that sender token. Otherwise it takes the
    sender token at the nearest earlier shared boundary (an offset where both tokenizations end a token). Before
    the first shared boundary it takes the first sender token. Many receiver tokens may take one sender token;
    nothing is averaged.
    """
    s_ends = [int(e) for e in sender_ends]
    r_ends = [int(e) for e in receiver_ends]
    s_index = {e: i for i, e in enumerate(s_ends)}             # last sender token ending at e
    shared = sorted(set(s_ends) & set(r_ends))
    out = np.zeros(len(r_ends), dtype=np.int64)
    for j, e in enumerate(r_ends):
        if e in s_index:
            out[j] = s_index[e]
            continue
        k = bisect.bisect_left(shared, e) - 1                    # nearest shared boundary strictly before e
        out[j] = s_index[shared[k]] if k >= 0 else 0
    return out


def index_pairing(n_sender: int, n_receiver: int) -> np.ndarray:
    """The ablation TA replaces: receiver token j takes sender token j (clipped to the sender's length)."""
    return np.minimum(np.arange(n_receiver), n_sender - 1)


def pair(sender_ends, receiver_ends, mode: str = "ta") -> np.ndarray:
    if mode == "ta":
        return token_alignment(sender_ends, receiver_ends)
    if mode == "index":
        return index_pairing(len(sender_ends), len(receiver_ends))
    raise ValueError(f"unknown pairing {mode!r} (ta | index)")


def multiplicity_weights(pairs: np.ndarray) -> np.ndarray:
    """1 / (number of receiver tokens sharing a sender token): many-to-one pairs count once in the statistics."""
    _, inv, counts = np.unique(pairs, return_inverse=True, return_counts=True)
    return 1.0 / counts[inv]


def proportional_layer(layer: int, n_receiver: int, n_sender: int) -> int:
    """pi(l): the seed's 1 + round((l-1)(L_S-1)/(L_R-1)) written 0-indexed, rounding halves up."""
    if n_receiver == 1:
        return 0
    return int(math.floor(layer * (n_sender - 1) / (n_receiver - 1) + 0.5))


def sender_layers(layer: int, n_receiver: int, n_sender: int, offsets=(-4, 0, 4)) -> list[int]:
    """pi(l) and its neighbours at `offsets`, clipped to the sender's depth, duplicates dropped, in order."""
    p = proportional_layer(layer, n_receiver, n_sender)
    out = []
    for o in offsets:
        s = min(max(p + o, 0), n_sender - 1)
        if s not in out:
            out.append(s)
    return out


def char_misalignment(sender_ends, receiver_ends, pairs: np.ndarray) -> float:
    """Mean |end offset of the paired sender token - receiver token end| in characters (the seed's Figure 5)."""
    s = np.asarray(sender_ends)[pairs]
    return float(np.abs(s - np.asarray(receiver_ends)).mean())
