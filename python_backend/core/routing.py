"""Routing a turn: an explicit adapter always wins; otherwise the MoL2 head scores the turn's pooled H19. The decision
is the 31-bit FNV-1a hash of the adapter's path (python_backend/core/fnv.py), which is what travels between processes.

The head is the trained MoL2 head saved beside the demo adapters. Without a head directory, `load_scorer` returns
None and requests must name their adapter (RouterStage says so in its error); it never falls back to an adapter
silently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from torch import Tensor

from .adapter_set import AdapterSet
from .fnv import BASE
from .inputs import RequestError

BASE_NAME = "base"  # the explicit `adapter` value that asks for no adapter


def load_scorer(settings, model=None, tokenizer=None):
    """The head's `score_adapter_set`. The option side reads only the token embedding: taken from `model` when the
    caller has one built (the engine), else read alone from the checkpoint (the `router` model builds no model)."""
    if settings.router_dir is None:
        return None
    from mol2_router import load_router  # the MoL2 package; imported only when a head exists
    from mol2_router.router import backbone_embedding

    if model is not None and hasattr(model, "get_input_embeddings"):  # a CED model (transformers' API)
        embedding = model.get_input_embeddings().weight
    else:  # no model built here, or a deepseek_v41 one: read from the checkpoint
        embedding = backbone_embedding(settings.model_dir)
    return load_router(settings.router_dir, tokenizer=tokenizer, embedding=embedding).score_adapter_set


@dataclass
class RouteDecision:
    adapter: str  # a name from the adapter set, or "base"
    adapter_hash: int
    scores: dict[str, float] = field(default_factory=dict)
    routed: bool = False  # chosen by the head (not named by the client)
    decision_ms: float = 0.0


class RouterStage:
    """`score` maps pooled H19 (C,) to one score per adapter of the set, or is None when no head is loaded."""

    def __init__(self, score: Callable[[Tensor, AdapterSet], dict[str, float]] | None):
        self.score = score

    def run(self, adapter_set: AdapterSet, h19_pooled: Tensor, explicit: str | None) -> RouteDecision:
        if explicit:
            if explicit == BASE_NAME:
                return RouteDecision(BASE_NAME, BASE)
            entry = adapter_set.by_name(explicit)
            if entry is None:
                known = ", ".join([BASE_NAME, *(a.name for a in adapter_set.adapters)])
                raise RequestError(f"unknown adapter {explicit!r}; this server offers: {known}")
            return RouteDecision(entry.name, entry.hash)
        if self.score is None or not adapter_set.adapters:
            raise RequestError("no router head is loaded for this adapter set: name an adapter in `adapter`")
        started = time.perf_counter()
        scores = self.score(h19_pooled, adapter_set)
        chosen = max(scores, key=scores.get)
        elapsed = (time.perf_counter() - started) * 1e3
        return RouteDecision(chosen, adapter_set.by_name(chosen).hash, scores, True, elapsed)
