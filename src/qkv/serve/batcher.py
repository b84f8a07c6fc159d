"""Dynamic batching: concurrent requests to one model, gathered and run as one batch on one thread.

A request is a :class:`Job`: its items (texts, or source/target pairs), their token count and a
``key`` (the decoding settings). :meth:`Batcher.submit` queues it and awaits its result. One
collector task takes the first waiting job, then keeps taking jobs for up to ``wait_ms`` or until
``max_tokens`` are gathered; jobs with the same key are joined into one call of ``run(key, items)``
on the model's single worker thread, and each job gets its slice of the results. While the worker
decodes one batch, new requests queue, so the busier the server, the larger its batches.

A batch that fails is run again one job at a time, so that one bad request gets its error and the
others their results; the collector goes on with the next batch either way. A failure of the engine
itself (an error with ``retry_after``: a worker that ended or did not answer) is not run again: every
request of the batch gets it (a 503, try again), and the next batch runs on the engine's new worker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


class Busy(Exception):
    """The model's queue is full: the client should try again later (HTTP 503)."""


@dataclass
class Job:
    key: Hashable
    items: list
    tokens: int
    future: asyncio.Future
    queued: float = field(default_factory=time.perf_counter)


@dataclass
class Stats:
    """What a batcher has done: requests answered, batches run (a batch: one ``run`` call), items
    decoded, failed requests, and the largest batch in requests."""

    requests: int = 0
    batches: int = 0
    items: int = 0
    failed: int = 0
    largest: int = 0

    def as_dict(self) -> dict[str, float]:
        mean = self.requests / self.batches if self.batches else 0.0
        return {"requests": self.requests, "batches": self.batches, "items": self.items, "failed": self.failed,
                "largest_batch": self.largest, "mean_requests_per_batch": round(mean, 3)}


class Batcher:
    """Runs ``run(key, items) -> results`` (one result per item) on one worker thread, batching
    concurrent :meth:`submit` calls of the same key. :meth:`call` runs any function on the same
    thread (a generation, which is not batched). Start it inside the server's event loop."""

    def __init__(self, run: Callable[[Hashable, list], list], name: str = "model", wait_ms: float = 5.0,
                 max_tokens: int = 4096, max_queue: int = 4096):
        self.run, self.name = run, name
        self.wait, self.max_tokens, self.max_queue = wait_ms / 1000, max_tokens, max_queue
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"qkv-serve-{name}")
        self.stats = Stats()
        self.on_batch: Callable[[Hashable, int, int], None] | None = None  # (key, requests, items): a hook for tests
        self.queue: asyncio.Queue[Job] | None = None
        self.task: asyncio.Task | None = None
        self.calls = 0  # calls() waiting for or running on the worker thread

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self.collect(), name=f"qkv-serve-batcher-{self.name}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, key: Hashable, items: list, tokens: int) -> list:
        """The results of ``items`` (in order), decoded in a batch with whatever else is waiting."""
        if self.queue is None or self.task is None or self.task.done():
            raise RuntimeError(f"the batcher of {self.name!r} is not running")
        if self.queue.qsize() + self.calls >= self.max_queue:
            raise Busy(f"model {self.name!r} has {self.max_queue} requests waiting; try again shortly")
        job = Job(key, list(items), max(int(tokens), 1), asyncio.get_running_loop().create_future())
        self.queue.put_nowait(job)
        return await job.future

    def check_room(self) -> None:
        """Raise :class:`Busy` when ``max_queue`` requests, batched or not, are already waiting."""
        if self.calls + (self.queue.qsize() if self.queue is not None else 0) >= self.max_queue:
            raise Busy(f"model {self.name!r} has {self.max_queue} requests waiting; try again shortly")

    async def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the worker thread, between batches; refused (:class:`Busy`) when ``max_queue``
        requests, batched or not, are already waiting."""
        self.check_room()
        self.calls += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        finally:
            self.calls -= 1

    async def collect(self) -> None:
        held: collections.deque[Job] = collections.deque()  # a job that did not fit the last batch
        loop = asyncio.get_running_loop()
        while True:
            jobs = [held.popleft() if held else await self.queue.get()]
            total = jobs[0].tokens
            deadline = loop.time() + self.wait
            while total < self.max_tokens:
                if held:
                    job = held.popleft()
                else:
                    try:
                        job = self.queue.get_nowait()
                    except asyncio.QueueEmpty:
                        timeout = deadline - loop.time()
                        if timeout <= 0:
                            break
                        try:
                            job = await asyncio.wait_for(self.queue.get(), timeout)
                        except TimeoutError:
                            break
                if total + job.tokens > self.max_tokens:
                    held.appendleft(job)
                    break
                jobs.append(job)
                total += job.tokens
            groups: dict[Hashable, list[Job]] = {}
            for job in jobs:
                if not job.future.done():  # a client that went away is not decoded for
                    groups.setdefault(job.key, []).append(job)
            for key, group in groups.items():
                await self.run_group(key, group)

    async def run_group(self, key: Hashable, group: list[Job]) -> None:
        items = [x for job in group for x in job.items]
        try:
            results = await asyncio.get_running_loop().run_in_executor(self.executor, self.run, key, items)
            if len(results) != len(items):
                raise RuntimeError(f"{len(items)} items gave {len(results)} results")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the request(s) it belongs to
            if getattr(e, "retry_after", None) is not None:  # the engine failed, not a request: each gets it
                self.stats.failed += len(group)
                for job in group:
                    if not job.future.done():
                        job.future.set_exception(e)
                return
            if len(group) > 1:  # find the job at fault: the others still get their results
                for job in group:
                    await self.run_group(key, [job])
                return
            self.stats.failed += 1
            if not group[0].future.done():
                group[0].future.set_exception(e)
            return
        self.stats.batches += 1
        self.stats.requests += len(group)
        self.stats.items += len(items)
        self.stats.largest = max(self.stats.largest, len(group))
        if self.on_batch is not None:
            self.on_batch(key, len(group), len(items))
        start = 0
        for job in group:
            part = results[start : start + len(job.items)]
            start += len(job.items)
            if not job.future.done():
                job.future.set_result(part)


__all__ = ["Batcher", "Busy", "Job", "Stats"]
