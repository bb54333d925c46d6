"""The ``n`` choices of one request: ``n`` generations sampled separately from one prompt.

Each choice is its own generation in the backend (request ids ``ID``, ``ID-1``, ... ``ID-(n-1)``,
each admitted, recorded and paged on its own; the prompt is prefilled for each, not shared). A
seeded request gives choice ``i`` the seed ``seed + i`` (mod 2**63 past the first), so the choices
differ and the whole answer repeats. ``Choices`` merges their chunks in arrival order, tagged with
the choice's index, and cancels them all together.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import msgspec

from residency.control.scheduler.port import Chunk, GenerateRequest, GenerationStream, Usage


def choice_requests(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """``req`` as the first of ``n`` choices, and the other ``n - 1``."""
    out = [req]
    seed = req.sampling.seed
    for i in range(1, n):
        sampling = req.sampling if seed is None else msgspec.structs.replace(req.sampling, seed=(seed + i) % (1 << 63))
        out.append(dataclasses.replace(req, request_id=f"{req.request_id}-{i}", sampling=sampling))
    return out


class Choices:
    def __init__(self, streams: Sequence[GenerationStream]):
        self.streams = list(streams)

    def cancel(self, reason: str) -> None:
        for s in self.streams:
            s.cancel(reason)

    async def merged(self) -> AsyncIterator[tuple[int, Chunk]]:
        """(choice index, chunk) as they come, until every choice has ended."""
        if len(self.streams) == 1:        # the usual case: no tasks, no queue
            async for chunk in self.streams[0]:
                yield 0, chunk
            return
        queue: asyncio.Queue = asyncio.Queue()
        ended = object()

        async def pump(i: int, stream: GenerationStream) -> None:
            try:
                async for chunk in stream:
                    await queue.put((i, chunk))
            finally:
                queue.put_nowait((i, ended))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        left = len(tasks)
        try:
            while left:
                i, chunk = await queue.get()
                if chunk is ended:
                    left -= 1
                    continue
                yield i, chunk
        finally:
            for t in tasks:
                t.cancel()


def total_usage(usages: Sequence[Usage | None]) -> Usage | None:
    """One request's usage over its choices: the prompt once (with what of it was cached), the
    completions and the prefill work of every choice."""
    us = [u for u in usages if u is not None]
    if not us:
        return None
    return Usage(prompt_tokens=us[0].prompt_tokens, completion_tokens=sum(u.completion_tokens for u in us),
                 cached_tokens=us[0].cached_tokens, restored_tokens=sum(u.restored_tokens for u in us),
                 computed_tokens=sum(u.computed_tokens for u in us), shared_tokens=us[0].shared_tokens)
