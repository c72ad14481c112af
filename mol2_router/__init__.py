"""MoL2: route each turn to a LoRA adapter with a pointer head on H19 (DESIGN §2), plus the two baselines it replaces.

    from mol2_router import load_router
    router = load_router("artifacts/demo/router")        # trained head + option cache, beside the demo adapters
    decision = router.decide(engine.prefill(state, turn)) # reads H19 only; the state is left untouched
"""

from .baselines import ContextualRouter, MoLRouter
from .config import PRESETS, RouterConfig, RouterConfigError
from .data import Candidate, Question, RouteDataError, read_questions, write_questions
from .features import RouteTokenizer, turn_tokens
from .head import OptionCache, PointerHead, QKHead
from .router import Decision, MoL2Router, load_router

__all__ = ["ContextualRouter", "MoLRouter", "PRESETS", "RouterConfig", "RouterConfigError", "Candidate", "Question",
           "RouteDataError", "read_questions", "write_questions", "RouteTokenizer", "turn_tokens", "OptionCache",
           "PointerHead", "QKHead", "Decision", "MoL2Router", "load_router"]
