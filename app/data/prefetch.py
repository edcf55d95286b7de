"""Work on the next items of a stream while the consumer works on the current one: the training loop's
batches are padded, pinned and copied to the device in a background thread while the device runs the
step before (the copies queue behind that step's kernels on the same stream)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item")
Ready = TypeVar("Ready")


class Prefetcher(Generic[Item, Ready]):
    """``prepare(item)`` for the items of ``source``, in order, ``depth`` items ahead of ``next()``. An
    exception in the background thread is raised by the ``next()`` that would have returned its item."""

    def __init__(self, source: Iterator[Item], prepare: Callable[[Item], Ready], depth: int = 1):
        self.source, self.prepare = source, prepare
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._work, name="prefetch", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            for item in self.source:
                if self.stopped.is_set():  # closed: no more work for items no one will take
                    return
                ready = self.prepare(item)
                while not self.stopped.is_set():
                    try:
                        self.queue.put((ready, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stopped.is_set():
                    return
        except BaseException as error:  # handed to the consumer
            self.queue.put((None, error))

    def __iter__(self) -> Prefetcher[Item, Ready]:
        return self

    def __next__(self) -> Ready:
        ready, error = self.queue.get()
        if error is not None:
            raise error
        return ready

    def close(self) -> None:
        """Stop the background thread: it finishes the item in hand, if any, and prepares no other (the queued
        one is dropped)."""
        self.stopped.set()
        while self.thread.is_alive():
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self.thread.join()
