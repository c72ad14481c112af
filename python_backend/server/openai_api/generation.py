"""One request's run through the engine: its deltas cut at the first stop string, the counts that `usage`, the
metrics and the access log report, and the request's place in the running / waiting lists. A failure is counted
by the access log (middleware.py), from the HTTP status or, after the first byte of a stream, from `failure`."""

from __future__ import annotations

import time
from typing import AsyncIterator

from .engine_client import EngineClient, EngineRequest
from .metrics import SERVED, Metrics
from .schema import APIError


class StopMatcher:
    """Stop strings matched on the decoded text, across deltas. Text that could still turn out to begin a stop
    string (a suffix that is a prefix of one) is held back until the next delta settles it, so nothing of a stop
    string is ever sent."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text, self.sent = "", 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """(the text that may go out now, whether a stop string was reached: nothing after it goes out)."""
        self.text += delta
        if not self.stops:
            return self.flush(), False
        # a match cannot start before `sent`: the text up to there was sent only once no stop could start in it
        hits = [i for i in (self.text.find(stop, self.sent) for stop in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.sent = self.text[self.sent:cut], cut
            self.text = self.text[:cut]
            return out, True
        tail = self.text[self.sent:]
        hold = next((k for k in range(min(self.longest - 1, len(tail)), 0, -1)
                     if any(stop.startswith(tail[-k:]) for stop in self.stops)), 0)
        safe = len(self.text) - hold
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def model_name(adapter: str) -> str:
    """The engine's applied_adapter as the API names it: the base model is `mol2`."""
    return SERVED if adapter in ("base", "") else adapter


class Generation:
    def __init__(self, engine: EngineClient, metrics: Metrics, request: EngineRequest, stops: list[str],
                 requested: str):
        self.engine, self.metrics, self.request, self.requested = engine, metrics, request, requested
        self.matcher = StopMatcher(stops)
        self.started = time.perf_counter()
        self.model = requested  # the adapter that answers, once known
        self.request_id = ""  # the answer's id (chatcmpl-..., cmpl-...), for log lines
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = self.replayed = 0
        self.finish_reason: str | None = None
        self.ttft_s: float | None = None  # seconds from arrival to the first token
        self.failure: int | None = None  # the status of an error that ended the answer after its first byte
        self.logprobs: list = []  # when asked: the engine's entry per token so far (token_logprobs.py reads them)
        self._logprobs_taken = 0
        self.conversation_id = ""  # a stateful turn's conversation (the engine names a new one)
        self._deltas = None
        self._first = None

    async def start(self) -> None:
        """Send the request and wait for its first token, so that a refused request becomes an HTTP error before
        any byte of a streamed answer is sent."""
        key = id(self)
        self.metrics.waiting_for(key, self.request.adapter if self.request.adapter not in (None, "base") else "")
        self._deltas = self.engine.stream(self.request)
        try:
            self._first = await anext(self._deltas)
        except StopAsyncIteration:
            self.metrics.done(key)
            raise APIError(500, "the engine ended the request without a response", code="engine_error") from None
        except BaseException:  # refused, or the client went away while it waited
            self.metrics.done(key)
            raise
        self.model = model_name(self._first.adapter)
        self.conversation_id = self._first.conversation_id
        self.ttft_s = time.perf_counter() - self.started
        self.metrics.first_token(key, self.model, self.ttft_s)

    async def pieces(self) -> AsyncIterator[str]:
        """The answer's text, piece by piece; afterwards `finish_reason` and the counts are set."""
        delta, engine_reason = self._first, ""
        try:
            while delta is not None:
                self.completion_tokens = max(self.completion_tokens, delta.output_tokens)
                self.replayed = max(self.replayed, delta.replayed_tokens)
                if delta.prompt_tokens is not None:
                    self.prompt_tokens = delta.prompt_tokens
                if delta.cached_tokens is not None:
                    self.cached_tokens = delta.cached_tokens
                engine_reason = delta.finish_reason or engine_reason
                self.logprobs += delta.logprobs or ()
                text, stopped = self.matcher.feed(delta.text)
                if text:
                    yield text
                if stopped:
                    self.finish_reason = "stop"
                    break
                delta = await anext(self._deltas, None)
            else:
                rest = self.matcher.flush()
                if rest:
                    yield rest
                self.finish_reason = engine_reason or (
                    "length" if self.completion_tokens >= self.request.max_tokens else "stop")
            self.metrics.finished(self.model, self.finish_reason, self.prompt_tokens, self.completion_tokens,
                                  self.cached_tokens, self.replayed)
        except APIError as error:
            self.failure = error.status
            raise
        finally:
            await self._deltas.aclose()  # cancels the engine's request if it is still running (a stop string)
            self.metrics.done(id(self))

    def new_logprobs(self) -> list:
        """The logprob entries that came since the last call (a streamed chunk's)."""
        entries, self._logprobs_taken = self.logprobs[self._logprobs_taken:], len(self.logprobs)
        return entries

    async def text(self) -> str:
        return "".join([piece async for piece in self.pieces()])

    async def close(self) -> None:
        """Cancel a started request whose pieces will not be read (one of n choices whose sibling failed)."""
        if self._deltas is not None:
            await self._deltas.aclose()
        self.metrics.done(id(self))

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
