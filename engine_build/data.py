"""Token data for pretraining and adapter training: corpus records -> token ids -> packed fixed-length rows.

A record becomes `<|bos|> text <|eos|>`, or the chat layout (`encode_chat`) when it has `turns`. A domain's
records are visited in a seeded shuffle (the corpus files are sorted by id, so file order would group sources),
their ids concatenated and cut into rows of `seq_len` tokens; the tail that does not fill a row is dropped.
With `max_doc_tokens`, each record contributes one seeded random window of at most that many tokens, so that a
few rows cover many documents (a domain of large files, such as the standard library's modules, would otherwise
fill a small budget from two or three of them).
Everything is a pure function of the corpus, the tokenizer, the seed and the token count asked for.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import torch
from tokenizers import Tokenizer
from torch import Tensor
from tqdm import tqdm

from .corpus import read_split
from .tokenizer import BOS, EOS, encode_chat


def record_ids(record: dict, tokenizer: Tokenizer) -> list[int]:
    """Token ids of one corpus record, with bos/eos (chat layout for conversational records)."""
    if record.get("turns"):
        return encode_chat([tuple(turn) for turn in record["turns"]], tokenizer)
    body = tokenizer.encode(record["text"], add_special_tokens=False).ids
    return [tokenizer.token_to_id(BOS)] + body + [tokenizer.token_to_id(EOS)]


def shuffled_records(corpus_dir: str | Path, domain: str, split: str, seed: int) -> list[dict]:
    records = list(read_split(corpus_dir, domain, split))
    random.Random(f"{seed}:{domain}:{split}").shuffle(records)
    return records


def iter_rows(records: list[dict], tokenizer: Tokenizer, seq_len: int, max_doc_tokens: int | None = None,
              seed: int = 0) -> Iterator[list[int]]:
    """Rows of exactly seq_len tokens packed from the records in order (each cut to max_doc_tokens if given)."""
    buffer: list[int] = []
    for record in records:
        ids = record_ids(record, tokenizer)
        if max_doc_tokens is not None and len(ids) > max_doc_tokens:
            start = random.Random(f"{seed}:{record['id']}").randrange(len(ids) - max_doc_tokens + 1)
            ids = ids[start: start + max_doc_tokens]
        buffer.extend(ids)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]


def packed_rows(corpus_dir: str | Path, domain: str, split: str, tokenizer: Tokenizer, seq_len: int,
                max_rows: int | None = None, seed: int = 0, progress: bool = False,
                max_doc_tokens: int | None = None) -> Tensor:
    """Up to `max_rows` packed rows (N, seq_len) int64 of one domain's split (all of it when max_rows is None)."""
    rows = []
    bar = tqdm(total=max_rows, desc=f"tokenize {domain}.{split}", unit="row", disable=not progress, leave=False)
    records = shuffled_records(corpus_dir, domain, split, seed)
    for row in iter_rows(records, tokenizer, seq_len, max_doc_tokens, seed):
        rows.append(row)
        bar.update()
        if max_rows is not None and len(rows) >= max_rows:
            break
    bar.close()
    return torch.tensor(rows, dtype=torch.long).view(-1, seq_len)


def mixture_counts(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Split `total` rows over domains in proportion to `weights` (largest remainders; the counts sum to total)."""
    norm = sum(weights.values())
    exact = {d: total * w / norm for d, w in weights.items()}
    counts = {d: int(x) for d, x in exact.items()}
    for d in sorted(exact, key=lambda d: counts[d] - exact[d])[: total - sum(counts.values())]:
        counts[d] += 1
    return counts
