"""MoL2: route each turn to a LoRA adapter with a pointer head on H19 (docs/architecture.md §2), plus the two
baselines it replaces.

    from mol2_router import RouteQuery, load_router
    router = load_router(demo.router_dir)       # trained head + option cache, beside the demo adapters (ced.demo)
    decision = router.decide(RouteQuery(engine.prefill(state, turn)), options)  # reads H19 only; the state untouched

MoL2 and the two baselines (MoL, Contextual MoL) share that call (mol2_router/interface.py).
"""

# Names resolved on first use (PEP 562), so that `mol2 router --help` and a module that needs one light piece
# (the data files, the config) do not load torch and the engine.
_WHERE = {"ContextualRouter": "baselines", "MoLRouter": "baselines", "PRESETS": "config", "RouterConfig": "config",
          "RouterConfigError": "config", "Candidate": "data", "Question": "data", "RouteDataError": "data",
          "read_questions": "data", "write_questions": "data", "RouteTokenizer": "features", "turn_tokens": "features",
          "OptionCache": "head", "PointerHead": "head", "QKHead": "head", "Decision": "interface",
          "RouteQuery": "interface", "Router": "interface", "MoL2Router": "router", "load_router": "router"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'mol2_router' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # found once
    return value
