"""What the engine core tells the `engine` model's stub (python_backend/core/engine_core.py ->
python_backend/triton/engine_model.py), one list of these per decode step and per iteration, pickled over the pipe
between the two processes (ours at both ends). Typed, so each side reads fields by name and a new field is one edit
here, not a tuple position to count at both ends."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Token:
    """A streamed token. `outputs`: the turn's constant outputs, on its first token only; `logprobs`: the token's
    [id, logprob, [[id, logprob], ...]] when the request asked (ced.engine.TokenLogprobs as lists)."""

    request_id: int
    token: int
    outputs: dict | None = None
    logprobs: list | None = None


@dataclass(slots=True)
class Final:
    """A turn's last event. `ids` (and `logprobs`): all of them when not streaming, None when they were streamed."""

    request_id: int
    ids: list[int] | None
    count: int
    finish_reason: str
    outputs: dict
    logprobs: list | None = None


@dataclass(slots=True)
class Failed:
    """A turn that ends without an answer: `message` None when the client cancelled it (an empty last response),
    else the error and the Triton code that sets its HTTP status (python_backend/core/server_errors.py's markers
    start the message of the server's own conditions)."""

    request_id: int
    message: str | None
    code: str | None


@dataclass(slots=True)
class Count:
    """A counter increment: the stub owns Triton's metrics."""

    metric: str
    adapter: str
    value: float = 1.0


Event = Token | Final | Failed | Count
