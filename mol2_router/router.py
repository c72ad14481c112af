"""The MoL2 router as serving uses it: a trained pointer head, its option cache, and one decision per request.

    router = load_router(demo.router_dir)          # head + config + options; embeddings from the backbone
    decision = router.decide(RouteQuery(h19), options)                     # reads H19 only, not the state
    decision = router.decide(RouteQuery(h19, explicit="coding"), options)  # an explicit adapter wins; no head runs

The option side (route prompt + each adapter's description through the token embedding, then the head's option
layers) is computed once per adapter set by `set_options` and cached; `decide` runs only the query projection,
the cross-attention and the pointer. The route prompt is the adapter set's own when serving gives one
(`score_adapter_set`), else the one the head was trained with (`route_prompt`, saved in config.json).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from torch import Tensor, nn

from .config import RouterConfig
from .data import Candidate
from .features import ROUTE_PROMPT, RouteTokenizer, option_tokens, pad_batch
from .head import OptionCache, PointerHead
from .interface import Decision, RouteQuery, Router

EMBEDDING_KEYS = ("model.embed_tokens.weight", "lm_head.weight")  # a CED checkpoint (one model.safetensors)
V41_EMBEDDING = "embed.weight"  # a deepseek_v41 checkpoint (shards and an index, native names; stored in BF16)


class MoL2Router(Router):
    name = "mol2"
    max_cached_sets = 8  # option caches kept, one per (route prompt, candidates); the oldest is dropped first

    def __init__(self, head: PointerHead, embedding: Tensor, tokenizer: RouteTokenizer,
                 candidates: Sequence[Candidate] = (), route_prompt: str = ROUTE_PROMPT):
        self.head = head.eval()
        self.config: RouterConfig = head.config
        self.embedding = embedding.detach().float()  # (V, C): the backbone's token embedding, frozen
        self.tokenizer = tokenizer
        self.route_prompt = route_prompt  # the prompt the head was trained with: the default, and what save() records
        self.prompt = route_prompt  # the prompt of the current option cache
        self.candidates: tuple[Candidate, ...] = ()
        self.cache: OptionCache | None = None
        self._caches: dict[tuple[str, tuple[Candidate, ...]], OptionCache] = {}
        if candidates:
            self.set_options(candidates)

    @torch.inference_mode()
    def set_options(self, candidates: Sequence[Candidate], route_prompt: str | None = None) -> OptionCache:
        """Make this adapter set current: its option side (route prompt + "name: description" of each candidate),
        computed on first use and cached per (route prompt, candidates). `route_prompt` defaults to the trained one."""
        candidates, prompt = tuple(candidates), self.route_prompt if route_prompt is None else route_prompt
        if not candidates:
            raise ValueError("no candidates: the router needs at least one adapter to choose from")
        key = (prompt, candidates)
        cache = self._caches.pop(key, None)
        if cache is None:
            ids = [option_tokens(self.tokenizer, c.option_text(), self.config.max_option_tokens, f"option {c.name!r}",
                                 prompt) for c in candidates]
            ids, lengths = pad_batch(ids)
            mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
            cache = self.head.encode_options(nn.functional.embedding(ids, self.embedding), mask,
                                             tuple(c.name for c in candidates))
        self._caches[key] = cache  # most recently used last
        while len(self._caches) > self.max_cached_sets:
            self._caches.pop(next(iter(self._caches)))
        self.candidates, self.prompt, self.cache = candidates, prompt, cache
        return cache

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.candidates)

    @torch.inference_mode()
    def scores(self, h19: Tensor) -> Tensor:
        """h19 (n, C) of the current user turn -> logits (N,) over the cached options."""
        if self.cache is None:
            raise RuntimeError("set_options first: no adapter set is cached")
        return self.head.score(h19.float().mean(0, keepdim=True), self.cache)[0]

    def route(self, query: RouteQuery) -> Decision:
        """Reads the turn's H19 only; the query's state is neither read nor written."""
        h19 = query.need("h19", self.name)
        started = time.perf_counter()
        return self._pick(self.scores(h19), ms=(time.perf_counter() - started) * 1e3)

    @torch.inference_mode()
    def route_batch(self, queries: Sequence[RouteQuery]) -> list[Decision]:
        """One head call for every query: each turn's H19 pooled to a row."""
        pooled = torch.stack([q.need("h19", self.name).float().mean(0) for q in queries])  # (B, C)
        return [self._pick(row) for row in self.head.score(pooled, self.cache)]  # (B, N)

    def _pick(self, logits: Tensor, ms: float = 0.0) -> Decision:
        """logits (N,) over the current options -> the decision for the best one."""
        index = int(logits.argmax())
        return Decision(self.candidates[index].name, True, index, logits, ms=ms)

    @torch.inference_mode()
    def score_pooled(self, pooled: Tensor) -> Tensor:
        """Already pooled H19 (C,) -> logits (N,) over the cached options."""
        return self.head.score(pooled.float().reshape(1, -1), self.cache)[0]

    def score_adapter_set(self, h19_pooled: Tensor, adapter_set) -> dict[str, float]:
        """Serving's hook (python_backend.core.routing): pooled H19 (C,) and the served adapter set (.route_prompt and
        entries with .name and .description) -> one score per adapter. The option side reads the set's route prompt
        (the trained one when the set has none) and is computed once per set: a request on a set seen before
        only looks its cache up."""
        candidates = tuple(Candidate(a.name, a.description) for a in adapter_set.adapters)
        prompt = getattr(adapter_set, "route_prompt", None) or self.route_prompt
        if candidates != self.candidates or prompt != self.prompt:
            self.set_options(candidates, prompt)
        return dict(zip(self.names, self.score_pooled(h19_pooled).tolist()))

    # -- on disk -------------------------------------------------------------------------------------------

    def save(self, folder: str | Path, backbone: str | Path | None = None, meta: dict | None = None) -> Path:
        """head.safetensors + config.json (+ tokenizer.json); `backbone` (a model folder) is recorded relative to
        `folder` so that load_router finds the token embedding without being given the model."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()}, str(folder / "head.safetensors"))
        tok_path = getattr(self.tokenizer, "path", "bytes")
        if tok_path != "bytes":
            source = Path(tok_path)
            source = source / "tokenizer.json" if source.is_dir() else source
            if source.resolve() != (folder / "tokenizer.json").resolve():
                shutil.copyfile(source, folder / "tokenizer.json")
        config = {"kind": "mol2", "router": self.config.to_dict(), "route_prompt": self.route_prompt,
                  "tokenizer": "tokenizer.json" if tok_path != "bytes" else "bytes",
                  "options": [{"name": c.name, "description": c.description} for c in self.candidates],
                  **(meta or {})}
        if backbone is not None:
            config["backbone"] = _relative(Path(backbone), folder)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return folder


def _relative(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target.resolve(), start.resolve())


def backbone_embedding(model_dir: str | Path) -> Tensor:
    """The token-embedding matrix (V, C) read straight from a CED checkpoint's model.safetensors, or from the shard
    a deepseek_v41 checkpoint's index names for `embed.weight`."""
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text())["weight_map"].get(V41_EMBEDDING)
        if shard is None:
            raise KeyError(f"{index}: names no {V41_EMBEDDING}")
        with safe_open(str(Path(model_dir) / shard), framework="pt") as f:
            return f.get_tensor(V41_EMBEDDING).float()
    path = Path(model_dir) / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        for key in EMBEDDING_KEYS:
            if key in f.keys():
                return f.get_tensor(key).float()
    raise KeyError(f"{path}: no token embedding among {EMBEDDING_KEYS}")


def load_router(folder: str | Path, model: nn.Module | None = None, tokenizer=None, embedding: Tensor | None = None,
                candidates: Sequence[Candidate] | None = None) -> MoL2Router:
    """The trained head in `folder` (config.json + head.safetensors), ready to decide.

    The token embedding comes from `embedding`, else `model.get_input_embeddings()`, else the checkpoint named by
    config["backbone"]. Options are tokenized with the folder's own tokenizer.json (the one the head was trained
    with), else with `tokenizer` (anything with .encode). Options default to the set the head was saved with."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder}: no config.json (not a router folder)")
    meta = json.loads(config_path.read_text())
    if meta.get("kind", "mol2") != "mol2":
        raise ValueError(f"{folder}: holds a {meta.get('kind')!r} head, not a MoL2 pointer head")
    head = PointerHead(RouterConfig.from_dict(meta["router"]))
    from safetensors.torch import load_file

    head.load_state_dict(load_file(str(folder / "head.safetensors")))
    if embedding is None and model is not None:
        embedding = model.get_input_embeddings().weight
    if embedding is None:
        if "backbone" not in meta:
            raise ValueError(f"{folder}: config.json names no backbone; pass model= or embedding=")
        embedding = backbone_embedding(folder / meta["backbone"])
    if meta.get("tokenizer", "bytes") != "bytes":
        tokenizer = RouteTokenizer(folder / meta["tokenizer"])
    elif tokenizer is None or isinstance(tokenizer, RouteTokenizer):
        tokenizer = tokenizer or RouteTokenizer("bytes")
    options = candidates if candidates is not None else [Candidate(o["name"], o["description"])
                                                         for o in meta.get("options", [])]
    return MoL2Router(head, embedding, tokenizer, options, meta.get("route_prompt", ROUTE_PROMPT))
