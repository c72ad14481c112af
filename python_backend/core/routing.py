"""The router head the `router` and `engine` models score with: the trained MoL2 head saved beside the demo adapters.

Without a head directory, `load_scorer` returns None and requests must name their adapter (the router stage
says so in its error); it never falls back to an adapter silently.
"""

from __future__ import annotations


def load_scorer(settings, model=None, tokenizer=None):
    """The head's `score_adapter_set`. The option side reads only the token embedding: taken from `model` when the
    caller has one built (the engine), else read alone from the checkpoint (the `router` model builds no model)."""
    if settings.router_dir is None:
        return None
    from mol2_router import load_router  # the MoL2 package; imported only when a head exists
    from mol2_router.router import backbone_embedding

    embedding = model.get_input_embeddings().weight if model is not None else backbone_embedding(settings.model_dir)
    return load_router(settings.router_dir, tokenizer=tokenizer, embedding=embedding).score_adapter_set
