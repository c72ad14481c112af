"""`logprobs` in OpenAI's shapes, from the engine's per-token entries ([token id, logprob, [[id, logprob], ...]]:
the distribution each token was drawn from, after penalties, grammar, temperature and filters; ced/engine.py
sample_with_logprobs). Chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`; completions: `{tokens,
token_logprobs, top_logprobs, text_offset}`. A token its distribution ruled out (-inf) reads -9999.0, as OpenAI writes
it (JSON has no infinity)."""

from __future__ import annotations

import math

from ced.tokenization import ChatTokenizer

RULED_OUT = -9999.0


class TokenTexts:
    """Each token id's bytes and text, read once from the served tokenizer."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int):
        self.pieces = tokenizer.vocabulary_bytes(vocab_size)

    def bytes(self, token: int) -> bytes:
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else RULED_OUT


def chat_logprobs(entries: list, texts: TokenTexts, top: int) -> dict:
    def one(token: int, logprob: float) -> dict:
        return {"token": texts.text(token), "logprob": _finite(logprob), "bytes": list(texts.bytes(token))}

    return {"content": [{**one(token, logprob), "top_logprobs": [one(*pair) for pair in alternatives[:top]]}
                        for token, logprob, alternatives in entries]}


def completion_logprobs(entries: list, texts: TokenTexts, top: int, offset: int = 0) -> dict:
    """`offset`: where the first of these tokens starts in the answer's text (a streamed chunk's)."""
    tokens, offsets = [], []
    for token, _, _ in entries:
        offsets.append(offset)
        tokens.append(texts.text(token))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_finite(logprob) for _, logprob, _ in entries],
            "top_logprobs": [{texts.text(t): _finite(lp) for t, lp in alternatives[:top]}
                             for _, _, alternatives in entries],
            "text_offset": offsets}
