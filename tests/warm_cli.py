"""``python -m app`` for the tests without paying its imports each time: a warm interpreter that forks.

A CLI run in the tests spends 4-7 s of a 2-core CPU importing torch (2.5 s), torch._dynamo (2.5 s: the
optimizer's first call imports it), datasets (1.2 s) and the rest, before its first line of work; the suite
starts several hundred. This module, run as a script, imports them once (and the project's modules that
the common commands import), then forks a child for each request. The child becomes what ``python -m app
ARGS`` is: its own session (its process group, which a test signals as a terminal's Ctrl-C does), the
request's folder, environment, standard input, output and error files, ``sys.argv`` and ``sys.path[0]``,
and it runs the package's ``__main__`` with runpy as ``-m`` does, ending through the interpreter's own exit
(exit handlers, threads joined, exit code). ``run`` waits for it as ``subprocess.run`` does; ``start``
returns it at once, as ``subprocess.Popen`` does.

What a fork shares with its siblings, and a fresh interpreter would not: the string hash seed, and the
modules imported before the fork (imported as ``app/__main__.py`` would, its oneDNN cache settings first).
So a test that compares two processes' outputs for exactness is marked fresh_interpreter: its runs fork, in
turn, warm interpreters started with string hash seeds of their own (``hash_seed``; tests/conftest.py). One that
needs another environment at import time asks for a fresh interpreter (``run_cli(..., fresh=True)``; any
``env=`` does too).
"""

from __future__ import annotations

import gc
import importlib
import io
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

# what app/__main__.py sets before torch is first imported
ONEDNN_CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
APP_MODULES = (
    "matplotlib.backends.backend_agg",
    "sacrebleu.metrics",
    "app.cli",
    "app.data.corpus",
    "app.train.trainer",
    "app.evaluation.eval_run",
    "app.report.evaluation_files",
    "app.decode.translate",
    "app.decode.likelihood",
)


def _preload() -> None:
    """The imports a CLI command pays, after the settings app/__main__.py makes before torch loads."""
    for cache in ONEDNN_CACHES:
        os.environ.setdefault(cache, "128")
    import datasets  # noqa: F401
    import hydra  # noqa: F401
    import matplotlib
    import omegaconf  # noqa: F401
    import sacrebleu  # noqa: F401
    import sentencepiece  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401

    matplotlib.use("Agg")
    del torch
    # the project's own modules that the common commands import (app/cli.py imports each command's lazily):
    # about 0.5 s of a tiny training's imports, 0.3 s of a refused command's
    for module in APP_MODULES:
        importlib.import_module(module)
    # the imports' ~420,000 objects out of the collector's full collections, which would walk them in every
    # fork (two in a tiny training: 0.5 s) and touch each page they lie on, copying it
    gc.freeze()


def _read_line(fd: int) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return b""
        line += chunk
    return line


def _serve() -> dict:
    """Answer requests until standard input closes; returns the request in a forked child."""
    _preload()
    os.write(1, b"ready\n")
    while True:
        line = _read_line(0)
        if not line:
            os._exit(0)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        os.write(1, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(1, f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _become(request: dict) -> None:
    """Turn this forked child into ``python -m app ARGS`` run as the request asks."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in (
        (0, request["stdin"] or os.devnull, os.O_RDONLY),
        (1, request["stdout"], written),
        (2, request["stderr"], written),
    ):
        if fd == 2 and path == request["stdout"]:  # one file for both, as stderr=subprocess.STDOUT
            os.dup2(1, 2)
            continue
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # new text streams on the new descriptors, as an interpreter makes them for files and pipes
    encoding = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", closefd=False), encoding=encoding)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", closefd=False), encoding=encoding, errors="backslashreplace", line_buffering=True
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["-m", *request["args"]]
    sys.path[0] = os.getcwd()  # as -m puts the working folder first


class WarmInterpreter:
    """The test side: one warm interpreter per test process, one request at a time."""

    def __init__(self, env: dict[str, str], cwd: str, hash_seed: int | None = None) -> None:
        """``hash_seed``: the string hash seed of the interpreter and so of its every fork (PYTHONHASHSEED at its
        start, not passed on to the forks' environment); a random one, as a user's interpreter has, if None."""
        self.env = dict(env)
        self.forks = 0  # the runs it answered
        self.lock = threading.Lock()
        self.log = tempfile.NamedTemporaryFile(prefix="warm_cli-", suffix=".log", delete=False)
        seeded = {} if hash_seed is None else {"PYTHONHASHSEED": str(hash_seed)}
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            cwd=cwd,
            env={**self.env, **seeded},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        self.buffer = b""
        if self._line(timeout=120) != "ready":
            raise RuntimeError(f"the warm interpreter did not start: {open(self.log.name).read()[-2000:]}")

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a fork can run in this environment: the one the interpreter imported in, but for the name of
        the running test, which pytest changes at each test and nothing imported reads."""
        return self.alive() and _without_test_name(env) == _without_test_name(self.env)

    def alive(self) -> bool:
        return self.process.poll() is None

    def _line(self, timeout: float | None) -> str | None:
        fd = self.process.stdout.fileno()
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the warm interpreter ended: {open(self.log.name).read()[-2000:]}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def start(
        self, cwd, args, env: dict[str, str], stdout: str, stderr: str, stdin: str | None = None, on_end=None
    ) -> Forked:
        """``python -m app ARGS`` started in a fork, writing to the files ``stdout`` and ``stderr`` (the same path
        for both merges them) and reading the file ``stdin``. The interpreter forks one at a time: the caller
        holds ``lock`` until the fork has ended (``on_end`` is called when its end is read)."""
        request = {"cwd": os.path.abspath(cwd), "args": list(args), "env": env, "stdin": stdin}
        self.process.stdin.write((json.dumps({**request, "stdout": stdout, "stderr": stderr}) + "\n").encode())
        self.process.stdin.flush()
        pid = self._line(timeout=60)
        if pid is None:
            raise RuntimeError(f"the warm interpreter did not fork in 60 s: {open(self.log.name).read()[-2000:]}")
        self.forks += 1
        return Forked(self, int(pid), [sys.executable, "-m", "app", *args], on_end)

    def run(self, cwd, args, stdin: str | None, timeout: float, env: dict[str, str]):
        """subprocess.run(python -m app ARGS, capture_output=True, text=True)'s result, from a fork."""
        with tempfile.TemporaryDirectory(prefix="warm_cli-") as folder:
            stdin_path = None
            if stdin is not None:
                stdin_path = os.path.join(folder, "stdin")
                with open(stdin_path, "w", encoding="utf-8") as f:
                    f.write(stdin)
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            child = self.start(cwd, args, env, out, err, stdin_path)
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                raise subprocess.TimeoutExpired(child.args, timeout, _read(out), _read(err)) from None
            return subprocess.CompletedProcess(child.args, code, _read(out), _read(err))

    def close(self) -> None:
        if self.alive():
            self.process.stdin.close()
            self.process.wait(30)
        self.log.close()
        os.unlink(self.log.name)


class Forked:
    """A forked ``python -m app`` as a ``subprocess.Popen`` is seen: ``pid`` (also its process group's: it leads
    its own session), ``poll``, ``wait``, ``send_signal``, ``kill`` and ``returncode``."""

    def __init__(self, interpreter: WarmInterpreter, pid: int, args: list[str], on_end=None) -> None:
        self.interpreter, self.pid, self.args, self.on_end = interpreter, pid, args, on_end
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, signum: int) -> None:
        """``signum`` to it (not to its process group), as ``Popen.send_signal`` sends one; nothing once it ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # ended, its end not yet read
                pass

    def kill(self) -> None:
        """SIGKILL to its process group (with what it started), then wait for its end."""
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended, its end not yet read
                pass
            self.wait(60)

    def _ended(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self.interpreter._line(timeout)  # the interpreter writes a child's exit code when it ends
            if line is not None:
                self.returncode = int(line)
                if self.on_end is not None:
                    self.on_end()
        return self.returncode


def _without_test_name(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key != "PYTEST_CURRENT_TEST"}


def _read(path: str) -> str:
    """A captured stream as subprocess.run(text=True) gives it (universal newlines)."""
    try:
        with open(path, encoding=locale.getpreferredencoding(False)) as f:
            return f.read()
    except FileNotFoundError:
        return ""


if __name__ == "__main__":
    _become(_serve())
    del _become, _serve, _preload
    import runpy

    runpy.run_module("app", run_name="__main__", alter_sys=True)
