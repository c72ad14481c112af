"""Tokens and offline H19 features: what the heads train on.

A query is the current user turn, `<|user|>{text}<|end|><|assistant|>`, after `<|bos|>` on a fresh
conversation; MoL2 pools H19 (mean) over the turn's positions. Contextual MoL appends the route prompt and every
option after the turn in the same (temporary) encoder pass and pools H19 over each option's span.

Extraction runs `model.run_shared` on right-padded batches: causal attention and whole-block compression mean
padding after a row's real tokens never changes its earlier positions (tests check this against
`CEDEngine.prefill`). Features are cached on disk in shards per dataset, resumable, with a progress bar.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from .data import Question, RouteDataError

BOS, EOS, PAD, USER, ASSISTANT, END = range(6)  # the demo tokenizer's special ids (engine_build.tokenizer)
ROUTE_PROMPT = "Route to:"  # shared prefix of every option (kept short: the option side runs per token)
MAX_QUERY_TOKENS = 1024


class RouteTokenizer:
    """Text -> ids: the demo BPE tokenizer (tokenizer.json), or UTF-8 bytes shifted past the specials ("bytes")."""

    def __init__(self, path: str | Path = "bytes"):
        self.path = str(path)
        self._tok = None
        if self.path != "bytes":
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json") if Path(path).is_dir() else str(path))

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            return [b + 6 for b in text.encode("utf-8")]
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        if self._tok is None:
            return bytes(i - 6 for i in ids if 6 <= i < 262).decode("utf-8", errors="replace")
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return 262 if self._tok is None else self._tok.get_vocab_size()


def turn_tokens(tokenizer: RouteTokenizer, text: str, max_tokens: int = MAX_QUERY_TOKENS) -> list[int]:
    """The user turn as the engine prefills it (without <|bos|>): what MoL2 pools H19 over."""
    return [USER] + tokenizer.encode(text)[: max_tokens - 3] + [END, ASSISTANT]


def option_tokens(tokenizer: RouteTokenizer, text: str, max_tokens: int, where: str = "",
                  route_prompt: str = ROUTE_PROMPT) -> list[int]:
    """Route prompt + one option's "name: description"; refuses an option over `max_tokens`."""
    ids = tokenizer.encode(f"{route_prompt} {text}")
    if len(ids) > max_tokens:
        raise RouteDataError(f"{where + ': ' if where else ''}option {text[:40]!r}... is {len(ids)} tokens with the "
                             f"route prompt, over max_option_tokens={max_tokens}")
    return ids


def pad_batch(rows: list[list[int]], pad: int = PAD) -> tuple[Tensor, Tensor]:
    """Right-padded ids (B, T) and lengths (B,)."""
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, lengths


def token_h19(h19: Tensor) -> Tensor:
    """One vector per position: H19 as is (B, T, C), or a model with mHC residual streams (deepseek_v41: H19 is
    (B, T, hc, C)) pooled over its streams, the paper's "mean over the inner axis"."""
    return h19.mean(dim=-2) if h19.dim() == 4 else h19


@torch.inference_mode()
def h19_batch(model, ids: Tensor, chunk: int = 256) -> Tensor:
    """H19 (B, T, C) of right-padded rows on fresh conversations, the encoder run in chunks of `chunk` positions.
    Either family: a CED (`model.ced`) or a deepseek_v41 model (`model.config`), whose streams are pooled."""
    E = (model.ced if hasattr(model, "ced") else model.config).decoder_start
    windows, stores = model.new_windows(range(E + 1)), model.new_stores()
    out = [token_h19(model.run_shared(ids[:, s: s + chunk], s, windows, stores).h19)
           for s in range(0, ids.shape[1], chunk)]
    return torch.cat(out, dim=1)


def span_means(h19: Tensor, spans: list[list[tuple[int, int]]]) -> list[Tensor]:
    """Per row, the mean of H19 over each [start, end) span: a list of (n_spans, C)."""
    return [torch.stack([h19[b, s:e].float().mean(0) for s, e in row]) for b, row in enumerate(spans)]


# -- what each router reads ---------------------------------------------------------------------------------

@dataclass
class Layout:
    """One question's token sequence and the spans the heads pool over."""

    ids: list[int]
    query: tuple[int, int]
    options: list[tuple[int, int]]


def mol2_layout(tokenizer: RouteTokenizer, question: Question, max_query_tokens: int = MAX_QUERY_TOKENS) -> Layout:
    turn = turn_tokens(tokenizer, question.query, max_query_tokens)
    return Layout([BOS] + turn, (1, 1 + len(turn)), [])


def contextual_layout(tokenizer: RouteTokenizer, question: Question, max_option_tokens: int,
                      max_query_tokens: int = MAX_QUERY_TOKENS) -> Layout:
    """<|bos|> turn, then each option (route prompt + "name: description", one line each) in the same pass."""
    ids = [BOS] + turn_tokens(tokenizer, question.query, max_query_tokens)
    query, options = (1, len(ids)), []
    for c in question.candidates:
        opt = option_tokens(tokenizer, c.option_text(), max_option_tokens, question.where) + tokenizer.encode("\n")
        options.append((len(ids), len(ids) + len(opt)))
        ids += opt
    return Layout(ids, query, options)


def extract(model, layouts: list[Layout], batch_size: int = 16, progress: bool = True,
            desc: str = "H19") -> tuple[Tensor, list[Tensor]]:
    """Pooled query H19 (n, C) and per-question option H19 (N_i, C) (empty when the layout has no options)."""
    order = sorted(range(len(layouts)), key=lambda i: len(layouts[i].ids))
    queries: list[Tensor | None] = [None] * len(layouts)
    options: list[Tensor | None] = [None] * len(layouts)
    bar = tqdm(total=len(layouts), desc=desc, disable=not progress, leave=False)
    for start in range(0, len(order), batch_size):
        batch = [layouts[i] for i in order[start: start + batch_size]]
        ids, _ = pad_batch([lay.ids for lay in batch])
        h19 = h19_batch(model, ids)
        for j, (i, lay) in enumerate(zip(order[start: start + batch_size], batch)):
            pooled = span_means(h19[j: j + 1], [[lay.query] + lay.options])[0]
            queries[i], options[i] = pooled[0], pooled[1:]
        bar.update(len(batch))
    bar.close()
    return torch.stack(queries), options


# -- the on-disk cache -----------------------------------------------------------------------------------------

def model_key(model_dir: str | Path) -> str:
    """Identity of a backbone checkpoint: its path and its weights file's size and mtime."""
    weights = Path(model_dir) / "model.safetensors"
    if not weights.exists():  # a sharded checkpoint (deepseek_v41's release format): its index names the weights
        weights = Path(model_dir) / "model.safetensors.index.json"
    stat = weights.stat()
    return hashlib.sha256(f"{Path(model_dir).resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def questions_key(questions: list[Question], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for q in questions:
        h.update(json.dumps(q.to_json(), sort_keys=True).encode())
    return h.hexdigest()[:16]


@dataclass
class Features:
    """Pooled query H19 (n, C); for Contextual MoL also every option's H19, flattened with offsets."""

    query: Tensor  # (n, C)
    options: Tensor | None = None  # (sum N_i, C)
    offsets: Tensor | None = None  # (n + 1,)

    def options_of(self, i: int) -> Tensor:
        return self.options[self.offsets[i]: self.offsets[i + 1]]


def cached_features(model, model_dir: str | Path, tokenizer: RouteTokenizer, questions: list[Question],
                    cache_dir: str | Path, kind: str = "mol2", max_option_tokens: int = 96,
                    shard_size: int = 256, batch_size: int = 16, progress: bool = True, log=print) -> Features:
    """Features of `questions` for `kind` ("mol2" or "contextual"), computed shard by shard and kept on disk.

    A run that stops keeps its finished shards; the next run computes only the missing ones. The cache key covers
    the checkpoint, the tokenizer, the questions and the layout, so a change in any of them starts afresh."""
    if kind not in ("mol2", "contextual"):
        raise ValueError(f"kind must be 'mol2' or 'contextual', got {kind!r}")
    key = questions_key(questions, f"{model_key(model_dir)}:{tokenizer.path}:{kind}:{max_option_tokens}:"
                                   f"{ROUTE_PROMPT}:{MAX_QUERY_TOKENS}")
    folder = Path(cache_dir) / f"{kind}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(json.dumps({"kind": kind, "model_dir": str(model_dir), "n": len(questions),
                                                  "shard_size": shard_size, "tokenizer": tokenizer.path}) + "\n")
    n_shards = (len(questions) + shard_size - 1) // shard_size
    todo = [s for s in range(n_shards) if not (folder / f"shard_{s:05d}.safetensors").exists()]
    if todo and log:
        log(f"extracting {kind} H19 for {len(questions)} questions: {len(todo)} of {n_shards} shards to do -> {folder}")
    for s in tqdm(todo, desc=f"{kind} shards", disable=not progress):
        chunk = questions[s * shard_size: (s + 1) * shard_size]
        layouts = [mol2_layout(tokenizer, q) if kind == "mol2" else contextual_layout(tokenizer, q, max_option_tokens)
                   for q in chunk]
        query, options = extract(model, layouts, batch_size, progress=progress, desc=f"shard {s}")
        tensors = {"query": query.contiguous()}
        if kind == "contextual":
            tensors["options"] = torch.cat(options).contiguous()
            tensors["counts"] = torch.tensor([len(o) for o in options])
        tmp = folder / f"shard_{s:05d}.tmp"
        save_file(tensors, str(tmp))
        tmp.rename(folder / f"shard_{s:05d}.safetensors")
    shards = [load_file(str(folder / f"shard_{s:05d}.safetensors")) for s in range(n_shards)]
    query = torch.cat([sh["query"] for sh in shards])
    if kind == "mol2":
        return Features(query)
    counts = torch.cat([sh["counts"] for sh in shards])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return Features(query, torch.cat([sh["options"] for sh in shards]), offsets)
