"""The router head the `router` model scores with: the trained MoL2 head saved beside the demo adapters.

Without a head directory, `load_scorer` returns None and requests must name their adapter (the router stage
says so in its error); it never falls back to an adapter silently.
"""

from __future__ import annotations


def load_scorer(settings, served):
    if settings.router_dir is None:
        return None
    from mol2_router import load_router  # the MoL2 package; imported only when a head exists

    router = load_router(settings.router_dir, served.engine.model, served.tokenizer)
    return router.score_adapter_set
