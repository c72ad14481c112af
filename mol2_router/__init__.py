"""MoL2: route each turn to a LoRA adapter with a pointer head on H19 (DESIGN §2), plus the two baselines it replaces.

    from mol2_router import RouteQuery, load_router
    router = load_router(demo.router_dir)       # trained head + option cache, beside the demo adapters (ced.demo)
    decision = router.decide(RouteQuery(engine.prefill(state, turn)), options)  # reads H19 only; the state untouched

MoL2 and the two baselines (MoL, Contextual MoL) share that call (mol2_router/interface.py).
"""

from .baselines import ContextualRouter, MoLRouter
from .config import PRESETS, RouterConfig, RouterConfigError
from .data import Candidate, Question, RouteDataError, read_questions, write_questions
from .features import RouteTokenizer, turn_tokens
from .head import OptionCache, PointerHead, QKHead
from .interface import Decision, RouteQuery, Router
from .router import MoL2Router, load_router

__all__ = ["ContextualRouter", "MoLRouter", "PRESETS", "RouterConfig", "RouterConfigError", "Candidate", "Question",
           "RouteDataError", "read_questions", "write_questions", "RouteTokenizer", "turn_tokens", "OptionCache",
           "PointerHead", "QKHead", "Decision", "RouteQuery", "Router", "MoL2Router", "load_router"]
