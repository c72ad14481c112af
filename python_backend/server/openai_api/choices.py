"""`n` > 1 on chat and completions: n engine requests for one prompt, one per choice.

The first choice is sent alone and the others once its first token is out: by then the engine has put the prompt's
end state in its prefix cache, so the other rows start from it instead of prefilling the prompt again (their
`cached_tokens` show it). With `seed`, choice 0 samples with the request's seed (so its answer is the n=1 answer)
and choice i with a seed derived from (seed, i): the whole answer repeats. `usage` sums the rows: each row's
prompt, what each found in the cache, and every choice's tokens. A Choices object stands where one Generation
stands for n=1: app.answer starts it and reads it, and the access log reads its counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib

from .engine_client import EngineClient, EngineRequest
from .generation import Generation
from .metrics import Metrics
from .schema import APIError
from .streaming import sse

DEFAULT_MAX_N = 8


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's for choice 0, a 63-bit hash of (seed, index) for the others."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # below 2**63, as a request's seed is


async def together(coroutines) -> list:
    """Their results, run concurrently. If one fails, or this is cancelled, the others are cancelled and awaited
    before the error goes on: none is left running (asyncio.gather alone leaves them)."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def check_n(n: int, max_n: int) -> None:
    if n > max_n:
        raise APIError(400, f"n: at most {max_n} choices per request on this server (max_n), got {n}", "n",
                       "invalid_value")


class Choices:
    def __init__(self, engine: EngineClient, metrics: Metrics, request: EngineRequest, stops: list[str],
                 requested: str, n: int):
        self.generations = [Generation(engine, metrics, dataclasses.replace(request, seed=choice_seed(request.seed, i)),
                                       stops, requested) for i in range(n)]
        self.request_id = ""
        self.failure: int | None = None

    async def start(self) -> None:
        first, *others = self.generations
        await first.start()
        try:
            await together(generation.start() for generation in others)
        except BaseException:
            await self.close()
            raise

    async def text(self) -> list[str]:
        """Every choice's whole text, in order."""
        try:
            return await together(generation.text() for generation in self.generations)
        finally:  # a choice whose text was never read (another failed first) still holds its engine request
            await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(generation.close() for generation in self.generations))

    async def pieces(self):
        """(index, text) as each choice's pieces come, then (index, None) when that choice has ended."""
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(index: int, generation: Generation) -> None:
            try:
                async for piece in generation.pieces():
                    await queue.put((index, piece))
                await queue.put((index, None))
            except Exception as error:  # noqa: BLE001 - raised where the events are read
                await queue.put((index, error))

        tasks = [asyncio.ensure_future(drain(i, g)) for i, g in enumerate(self.generations)]
        try:
            for _ in range(len(tasks)):
                while True:
                    index, item = await queue.get()
                    if isinstance(item, Exception):
                        self.failure = getattr(item, "status", 500)
                        raise item
                    yield index, item
                    if item is None:
                        break
        finally:  # the stream closed early (or one choice failed): the others' engine requests are cancelled
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()

    # what usage, the access log and the metrics read, over every choice
    @property
    def model(self) -> str:
        return self.generations[0].model

    @property
    def prompt_tokens(self) -> int:
        return sum(g.prompt_tokens for g in self.generations)

    @property
    def cached_tokens(self) -> int:
        return sum(g.cached_tokens for g in self.generations)

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.generations)

    @property
    def ttft_s(self) -> float | None:
        return self.generations[0].ttft_s

    @property
    def finish_reason(self) -> str | None:
        reasons = [g.finish_reason for g in self.generations if g.finish_reason]
        return ",".join(dict.fromkeys(reasons)) or None

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def chat_answer(choices: Choices, answer_id: str, created: int, include_usage: bool, stream: bool):
    """What app.answer sends for a chat request with n choices: the whole answer from the texts, or its events."""
    generations = choices.generations

    def whole(texts: list[str]) -> dict:
        return {"id": answer_id, "object": "chat.completion", "created": created, "model": choices.model,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": generations[i].finish_reason} for i, text in enumerate(texts)],
                "usage": choices.usage(), "system_fingerprint": None}

    def chunk(index: int, delta: dict, finish_reason: str | None = None) -> str:
        payload = {"id": answer_id, "object": "chat.completion.chunk", "created": created, "model": choices.model,
                   "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    async def events():
        for index in range(len(generations)):
            yield chunk(index, {"role": "assistant", "content": ""})
        async with contextlib.aclosing(choices.pieces()) as pieces:  # closed with the stream: cancels
            async for index, piece in pieces:
                yield chunk(index, {"content": piece}) if piece is not None else \
                    chunk(index, {}, generations[index].finish_reason)
        if include_usage:
            yield sse({"id": answer_id, "object": "chat.completion.chunk", "created": created,
                       "model": choices.model, "choices": [], "usage": choices.usage()})

    return events if stream else whole


def completion_answer(choices: Choices, answer_id: str, created: int, include_usage: bool, stream: bool):
    """The same for a completions request."""
    generations = choices.generations

    def choice(index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def whole(texts: list[str]) -> dict:
        return {"id": answer_id, "object": "text_completion", "created": created, "model": choices.model,
                "choices": [choice(i, text, generations[i].finish_reason) for i, text in enumerate(texts)],
                "usage": choices.usage(), "system_fingerprint": None}

    def chunk(items: list, usage: dict | None = None) -> str:
        payload = {"id": answer_id, "object": "text_completion", "created": created, "model": choices.model,
                   "choices": items}
        if include_usage:
            payload["usage"] = usage
        return sse(payload)

    async def events():
        async with contextlib.aclosing(choices.pieces()) as pieces:
            async for index, piece in pieces:
                yield chunk([choice(index, piece, None) if piece is not None else
                             choice(index, "", generations[index].finish_reason)])
        if include_usage:
            yield chunk([], choices.usage())

    return events if stream else whole
