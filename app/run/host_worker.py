"""A process beside training for validation's host work (scoring the dev translations, drawing heatmaps
as PNG), so that it runs while the training process does the model's forward passes instead of after them;
``make eval`` sends it TER (pure Python, seconds) while it writes its files.

One worker per process, started on first use (training asks for it before it loads its data, so that it
starts up beside that) and reused by every validation: a fresh interpreter (spawn: no CUDA state, threads
or tensors inherited; it loads numpy, matplotlib and sacrebleu, not torch). Jobs are module-level functions
and their arguments, run in the order sent; each validation collects the results of its own jobs before it
returns, so nothing is pending between validations and none is lost.

Shutdown. The worker reads jobs from a pipe whose sending end this process alone holds: when this process
ends, however it ends, the worker reads end-of-file and exits. At interpreter exit that pipe is closed and
the worker joined (no zombie); one whose results nobody will read (a validation a signal cut short) is killed
at once instead of finishing its job. It ignores SIGINT and SIGTERM, which a terminal's Ctrl-C or a ``kill`` of
the process group sends to every process of the group: stopping is the training process's to handle
(app/train/stop_rules.py), and the worker ends with it. It is started with SIGINT ignored, so that a Ctrl-C
while it starts up does not end it with a traceback. Should the worker fail to start or die, its jobs run in
this process instead: the same functions, the same results."""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import multiprocessing
import queue
import signal
import sys
import threading
import traceback
import types
from collections import deque
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

log = logging.getLogger(__name__)
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the training process's to handle, not the worker's


def _serve(jobs, results, preload: tuple[str, ...]) -> None:
    """The worker's loop: run each (function, args) received, send back (ok, value) in the same order.
    ``preload``: modules imported at once, while the first jobs are still being prepared. When it ends, the
    collector's objects are frozen (as app/__main__.py does): the process that waits for it at exit does not
    wait for its shutdown to collect what numpy and matplotlib made."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    for module in preload:
        importlib.import_module(module)
    try:
        while True:
            try:
                fn, args = jobs.recv()
            except (EOFError, OSError):  # the training process closed the pipe or is gone
                return
            try:
                reply = (True, fn(*args))
            except Exception as error:
                reply = (False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
            try:
                results.send(reply)
            except OSError:  # the training process no longer reads results: it is closing or gone
                return
    finally:
        gc.freeze()


class Job:
    """A function call sent to the worker (or, without one, run at once); ``result()`` waits for it."""

    def __init__(self, worker: Optional[HostWorker], fn: Callable, args: tuple):
        self._worker, self._fn, self._args = worker, fn, args
        self._reply: Optional[tuple[bool, Any]] = None  # (ok, value or the worker's traceback)
        if worker is None:
            self._run_here()

    def _run_here(self) -> None:
        self._reply = (True, self._fn(*self._args))

    def result(self) -> Any:
        while self._reply is None:
            if self._worker is None or self._worker.broken:
                self._run_here()
            else:
                self._worker.receive_next()
        ok, value = self._reply
        if not ok:
            raise RuntimeError(f"{self._fn.__module__}.{self._fn.__qualname__} failed in the host worker: {value}")
        return value


class HostWorker:
    """The worker process and the jobs sent to it whose results are not in yet."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        context = multiprocessing.get_context("spawn")
        self._results, results_end = context.Pipe(duplex=False)
        jobs_end, self._jobs = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_serve, args=(jobs_end, results_end, preload), name="host-worker", daemon=True
        )
        # spawn runs the caller's main script again in the worker (as __mp_main__) when it was started as a
        # file: a user's script without ``if __name__ == "__main__"`` that trains would train again there.
        # The worker needs none of it (jobs are module-level functions, sent by name): it starts from a main
        # module with no file.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        # SIGINT ignored from its first instruction (an ignored signal stays ignored across exec), not only once
        # _serve runs: a Ctrl-C while it starts would end it with a traceback. This process ignores one for the
        # few milliseconds of the start (the user presses again); SIGTERM ends a starting worker without a word.
        ignoring = threading.current_thread() is threading.main_thread()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignoring else None
        try:
            self._process.start()
        finally:
            if ignoring:
                signal.signal(signal.SIGINT, handler)
            sys.modules["__main__"] = main
        jobs_end.close()  # the worker holds the other copies: this process keeps only its own ends
        results_end.close()
        self._pending: deque[Job] = deque()
        self.broken = False
        # A pipe holds 64 KiB: writing a larger job would block the caller until the worker reads it, after
        # the jobs before it. A thread writes them instead (in the pipe's write call, without the GIL).
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="host-worker-sender", daemon=True)
        self._sender.start()

    def _send_all(self) -> None:
        while (payload := self._outbox.get()) is not None:
            try:
                self._jobs.send_bytes(payload)
            except (OSError, ValueError):  # the worker is gone: receive_next finds out
                return

    def submit(self, fn: Callable, *args) -> Job:
        """``fn(*args)`` sent to the worker (a module-level function: it is sent by name)."""
        job = Job(self, fn, args)
        if not self.broken:
            self._outbox.put(ForkingPickler.dumps((fn, args)))  # pickled here: an unpicklable job fails here
            self._pending.append(job)
        return job

    def receive_next(self) -> None:
        """The oldest pending job's result. If the worker died, it is broken: jobs without a result then
        run here when asked for (``Job.result``). Interrupted while reading it (a signal that stops training, in
        the middle of a message perhaps), the worker is given up on: stopped, broken, its results unread."""
        try:
            ok, value = self._results.recv()
        except (EOFError, OSError) as error:
            self._fail(error)
            return
        except BaseException:
            self.broken, self._pending = True, deque()
            self._process.kill()
            self.close()
            raise
        self._pending.popleft()._reply = ok, value

    def _fail(self, error: BaseException) -> None:
        self.close()
        log.warning(
            "host worker process stopped (%s, exit code %s): its host work runs in this process",
            error,
            self._process.exitcode,
        )
        self.broken, self._pending = True, deque()

    def close(self) -> None:
        """Send the worker end-of-file after its jobs (it exits once they are done) and wait for it; one with jobs
        whose results no one will read is stopped at once."""
        if self._pending:
            self._process.kill()
        self._outbox.put(None)
        self._sender.join(timeout=30)
        self._jobs.close()
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()  # it ignores SIGTERM
            self._process.join()
        self._results.close()


_worker: Optional[HostWorker] = None
_unavailable = False  # the worker could not start, or died: host work stays in this process


def host_worker(preload: tuple[str, ...] = ()) -> Optional[HostWorker]:
    """This process's worker, started on first use (importing the modules of ``preload``); None where
    there is none (jobs then run here)."""
    global _worker, _unavailable
    if _worker is None and not _unavailable:
        try:
            _worker = HostWorker(preload)
        except (OSError, RuntimeError) as error:
            log.warning("no host worker process (%s): host work runs in this process", error)
            _unavailable = True
            return None
        atexit.register(_worker.close)
    if _worker is not None and _worker.broken:
        _worker, _unavailable = None, True
    return _worker


def submit(worker: Optional[HostWorker], fn: Callable, *args) -> Job:
    """``fn(*args)`` in ``worker``, or here and now without one."""
    return worker.submit(fn, *args) if worker is not None else Job(None, fn, args)
