"""Concurrent requests gathered into one decoding call: the first request of a batch waits ``serve.batch_wait_ms``
for others (up to ``serve.max_batch_lines`` lines); the requests gathered are grouped by what their decoding
depends on (beam size, n-best, attention), each group decoded in one call on one worker thread (the device runs
one call at a time), and each request gets its own lines' results back.

A call that runs the device out of memory is decoded again request by request, so that only the request that
does not fit is refused; the others are answered."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

# decode(sources of every line, key) -> one result per line; key: what the lines of one call share
Decode = Callable[[list[Any], Hashable], list[Any]]


@dataclass
class PendingRequest:
    sources: list[Any]
    key: Hashable
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class RequestBatcher:
    """``await batcher.submit(sources, key)``: the results of ``decode`` for ``sources``, decoded together with
    those of the other requests that arrived within ``wait_s`` of the first one waiting."""

    def __init__(self, decode: Decode, wait_s: float, max_lines: int):
        self.decode, self.wait_s, self.max_lines = decode, wait_s, max_lines
        self.queue: asyncio.Queue[PendingRequest] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        self.task: asyncio.Task | None = None
        self.calls = 0  # decoding calls made
        self.lines = 0  # lines decoded
        self.answered = 0.0  # when the last call's answers were sent
        self.last_jobs = 0  # and to how many requests
        self.held: PendingRequest | None = None  # the request the last batch had no room for: the next one's first

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, sources: list[Any], key: Hashable) -> list[Any]:
        job = PendingRequest(sources, key, asyncio.get_running_loop().create_future())
        await self.queue.put(job)
        return await job.future

    async def gather(self) -> list[PendingRequest]:
        """The next batch: the first job waiting, and those arriving within ``wait_s`` of it, as long as their
        lines fit ``max_lines`` (a job that does not fit is the next batch's first)."""
        first, self.held = self.held or await self.queue.get(), None
        jobs, lines = [first], len(first.sources)
        # from the first job's arrival, or from the answers of the last call: the clients answered then send their
        # next requests within the wait and join this batch (else two cohorts take turns at half the batch each)
        deadline = max(jobs[0].arrived, self.answered if self.last_jobs > 1 else 0.0) + self.wait_s
        while lines < self.max_lines:
            left = deadline - time.monotonic()
            try:
                job = self.queue.get_nowait() if left <= 0 else await asyncio.wait_for(self.queue.get(), left)
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            if lines + len(job.sources) > self.max_lines:
                self.held = job
                break
            jobs.append(job)
            lines += len(job.sources)
        return jobs

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self.gather()
            groups: dict[Hashable, list[PendingRequest]] = {}
            for job in jobs:
                groups.setdefault(job.key, []).append(job)
            for key, group in groups.items():
                try:
                    await loop.run_in_executor(self.executor, self.decode_group, key, group)
                except Exception as err:  # a bug in decode_group itself: answer, do not stop serving
                    log.exception("serve: decoding failed")
                    for job in group:
                        if not job.future.done():
                            job.future.set_exception(err)

    def decode_group(self, key: Hashable, jobs: list[PendingRequest]) -> None:
        """Decode the jobs of one key in one call (on the worker thread); each job's future gets its results or
        the exception of its call. Out of memory with several jobs: each job again on its own."""
        try:
            results = self.call([s for job in jobs for s in job.sources], key)
        except torch.OutOfMemoryError as err:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if len(jobs) == 1:
                return self.answer(jobs[0], exception=err)
            log.warning("serve: out of memory on %d requests together: decoding them one at a time", len(jobs))
            for job in jobs:
                self.decode_group(key, [job])
            return None
        except Exception as err:
            for job in jobs:
                self.answer(job, exception=err)
            return None
        start = 0
        for job in jobs:
            self.answer(job, results[start : start + len(job.sources)])
            start += len(job.sources)
        self.answered, self.last_jobs = time.monotonic(), len(jobs)
        return None

    def call(self, sources: list[Any], key: Hashable) -> list[Any]:
        self.calls += 1
        self.lines += len(sources)
        return self.decode(sources, key)

    def answer(self, job: PendingRequest, results: Any = None, exception: BaseException | None = None) -> None:
        loop = job.future.get_loop()

        def settle() -> None:
            if job.future.done():  # the client went away
                return
            if exception is not None:
                job.future.set_exception(exception)
            else:
                job.future.set_result(results)

        loop.call_soon_threadsafe(settle)
