"""A request's values as the engine receives them (numpy arrays keyed by input name, from a Triton model or the
engine core's pipe): read one by one, each refusal a RequestError naming the input. No Triton here: the core reads
the same inputs in a process of its own."""

from __future__ import annotations

MAX_NEW_TOKENS = 4096  # one request's new tokens, at most


class RequestError(ValueError):
    """A request the server refuses; the message goes back to the client."""


def as_text(value, name: str) -> str | None:
    if value is None or value.size == 0:
        return None
    if value.size != 1:
        raise ValueError(f"{name} must hold one string, got shape {value.shape}")
    item = value.reshape(-1)[0]
    if not isinstance(item, bytes):
        return str(item)
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError as error:  # a lone surrogate arrives so too (CESU bytes such as ED A0 80)
        raise RequestError(f"{name} is not valid UTF-8 text: {error.reason} at byte {error.start} "
                           f"({item[error.start:error.start + 3].hex(' ')})") from None


def text_size(value) -> int:
    """The bytes of a one-string input, read without decoding it (0 when absent): sizes are checked first."""
    if value is None or value.size != 1:
        return 0
    item = value.reshape(-1)[0]
    return len(item) if isinstance(item, bytes) else len(str(item).encode("utf-8", "surrogatepass"))


def as_scalar(value, name: str, kind: type, default):
    if value is None or value.size == 0:
        return default
    if value.size != 1:
        raise ValueError(f"{name} must hold one value, got shape {value.shape}")
    return kind(value.reshape(-1)[0])


def generation(get, stop_token_ids=None):
    """`max_tokens` (1..MAX_NEW_TOKENS, default 64) and the sampling settings (greedy by default; a grammar and
    logprobs when asked: `structured_output`, `logprobs`) of a request,
    read through `get(name, kind, default)` (and `stop_token_ids`, the input's array, if sent): the one place both
    are parsed, whichever model receives the turn. Out of range: a RequestError naming the field."""
    from ced.engine import SamplingParams  # here: the models that import this module without generating have no torch

    max_tokens = get("max_tokens", int, 64)
    if not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise RequestError(f"max_tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_tokens}")
    stops = () if stop_token_ids is None else tuple(int(token) for token in stop_token_ids.reshape(-1))
    try:
        return max_tokens, SamplingParams(
            temperature=get("temperature", float, 0.0), top_k=get("top_k", int, 0), top_p=get("top_p", float, 1.0),
            seed=get("seed", int, None), min_p=get("min_p", float, 0.0),
            repetition_penalty=get("repetition_penalty", float, 1.0),
            presence_penalty=get("presence_penalty", float, 0.0),
            frequency_penalty=get("frequency_penalty", float, 0.0), min_tokens=get("min_tokens", int, 0),
            stop_token_ids=stops, grammar=_grammar(get("structured_output", _utf8, None)),
            logprobs=get("logprobs", int, None))
    except ValueError as error:
        raise RequestError(str(error)) from None


def _utf8(item) -> str:
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def _grammar(text: str | None) -> str | None:
    """`structured_output` checked here, where the request arrives: a malformed schema or regex is the client's 400,
    never a failure in the middle of a batched step."""
    if text is None:
        return None
    from .structured import GrammarSpec

    return GrammarSpec.from_json(text).to_json()
