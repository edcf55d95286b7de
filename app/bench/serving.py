"""``make bench ARGS="name=<run> bench.serve=true"``: requests/s and latency of make serve's API for one client at a
time, then for ``serve.bench_clients`` concurrent clients, each sending single sentences of the run's test split
(``decode.beam_size``, no attention: what an API client asks for) for ``serve.bench_seconds``.

The server runs as make serve runs it, in a process of its own (spawned), so the clients (threads here, waiting
on their sockets) do not share its interpreter; on a 2-core CPU they share its cores. Prints a table and writes
``checkpoints/bench/serve_<run>.json``."""

from __future__ import annotations

import dataclasses
import http.client
import json
import multiprocessing
import os
import queue
import signal
import threading
import time
from typing import Any

import numpy as np
import torch
import uvicorn

from app.config.schema import Config
from app.run.errors import UserError
from app.run.files import atomic_write_text
from app.serve.engine import load_engine
from app.serve.routes import create_app
from app.serve.server import bind

WARMUP_REQUESTS = 8  # per load, untimed: the first calls allocate and warm the caches


def run_server(cfg: Config, ready) -> None:
    """The server of ``cfg`` on a free port of 127.0.0.1 (in the spawned process): its address to ``ready``."""
    try:
        engine = load_engine(cfg)
        sock = bind("127.0.0.1", 0)
    except UserError as err:
        ready.put(("error", str(err)))
        return
    data_dir = engine.trained.config.data.dir if engine.trained else cfg.data.dir  # the run's corpus
    ready.put(("ready", sock.getsockname()[1], engine.info, data_dir))
    config = uvicorn.Config(create_app(engine, cfg.serve, cfg.decode), log_level="warning", access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # the signal that stopped it, raised again once it has shut down
        pass


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, Any]:
    """(status, parsed JSON answer) of one HTTP request to the server on 127.0.0.1:``port``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def load(port: int, sentences: list[str], clients: int, seconds: float, beam_size: int) -> dict[str, Any]:
    """``clients`` threads, each sending one sentence at a time (the next once answered) for ``seconds``:
    requests/s and latency percentiles (ms) of the answered requests."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    failures: list[str] = []
    start_line = threading.Barrier(clients + 1)
    deadline = [0.0]

    def client(c: int) -> None:
        start_line.wait()
        i = c * 97
        while time.monotonic() < deadline[0]:
            begin = time.monotonic()
            body = {"text": [sentences[i % len(sentences)]], "beam_size": beam_size}
            status, answer = request(port, "POST", "/translate", body)
            if status != 200:
                failures.append(f"{status}: {answer}")
                return
            latencies[c].append(time.monotonic() - begin)
            i += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for thread in threads:
        thread.start()
    deadline[0] = time.monotonic() + seconds
    begin = time.monotonic()
    start_line.wait()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - begin
    if failures:
        raise RuntimeError(f"a request failed: {failures[0]}")
    if not any(latencies):
        raise UserError(f"no request was answered in serve.bench_seconds={seconds}: give it more time")
    flat = np.array([x for xs in latencies for x in xs]) * 1000
    return {
        "clients": clients,
        "requests": int(flat.size),
        "requests_per_s": round(flat.size / elapsed, 2),
        "p50_ms": round(float(np.percentile(flat, 50)), 1),
        "p95_ms": round(float(np.percentile(flat, 95)), 1),
        "seconds": round(elapsed, 1),
    }


def test_sentences(data_dir: str) -> list[str]:
    path = os.path.join(data_dir, "test.tsv")
    if not os.path.exists(path):
        raise UserError(f'{path} does not exist: make data ARGS="..." (the run\'s data= settings) writes it')
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n").split("\t")[1] for line in f if line.strip()]


def first_message(ready, server, timeout: float = 600.0) -> tuple:
    """The server process's first message (ready, or its one-line error); a process that ends without one (its
    traceback is on the terminal) is said so at once instead of waiting out ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return ready.get(timeout=1.0)
        except queue.Empty:
            if not server.is_alive():
                ended = f"the server process ended (exit code {server.exitcode}) before it was ready"
                raise RuntimeError(ended) from None
    raise RuntimeError(f"the server process was not ready after {timeout:.0f} s")


def bench_serve(cfg: Config) -> dict[str, Any]:
    # make bench keeps its log in checkpoints/bench (app/cli.py): the run served is checkpoints/<name>
    cfg = dataclasses.replace(cfg, run_dir=os.path.join("checkpoints", cfg.name))
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    server = context.Process(target=run_server, args=(cfg, ready), daemon=True)
    server.start()
    serving = False
    try:
        message = first_message(ready, server)
        if message[0] == "error":
            raise UserError(message[1])
        _, port, info, data_dir = message
        serving = True
        sentences = test_sentences(data_dir)
        beam, n, seconds = cfg.decode.beam_size, cfg.serve.bench_clients, cfg.serve.bench_seconds
        rows = []
        for clients in (1, n):
            for k in range(WARMUP_REQUESTS):
                request(port, "POST", "/translate", {"text": [sentences[k]], "beam_size": beam})
            before = request(port, "GET", "/info")[1]["decoded"]
            row = load(port, sentences, clients, seconds, beam)
            after = request(port, "GET", "/info")[1]["decoded"]
            calls = after["calls"] - before["calls"]
            row["lines_per_call"] = round((after["lines"] - before["lines"]) / max(calls, 1), 2)
            rows.append(row)
    finally:
        if serving and server.pid is not None:  # else it ends by itself: a signal would interrupt its exit
            os.kill(server.pid, signal.SIGINT)  # uvicorn shuts down gracefully
        server.join(30)
        if server.is_alive():
            server.kill()
    result = {
        "run": cfg.name,
        "engine": info["engine"],
        "step": info["step"],
        "device": info["device"],
        "cpu_threads": torch.get_num_threads(),
        "beam_size": beam,
        "batch_wait_ms": cfg.serve.batch_wait_ms,
        "sentences": "single sentences of the test split, in order from a different place per client",
        "loads": rows,
        "speedup": round(rows[1]["requests_per_s"] / rows[0]["requests_per_s"], 2),
    }
    print(table(result))
    out = os.path.join("checkpoints", "bench", f"serve_{cfg.name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


def table(result: dict[str, Any]) -> str:
    head = (
        f"make serve, run {result['run']} (step {result['step']}, engine {result['engine']}, {result['device']}), "
        f"beam {result['beam_size']}, serve.batch_wait_ms={result['batch_wait_ms']}:"
    )
    columns = "| clients | requests/s | p50 ms | p95 ms | lines per decoding call | requests |"
    lines = [head, columns, "| --- " * 6 + "|"]
    for r in result["loads"]:
        lines.append(
            f"| {r['clients']} | {r['requests_per_s']} | {r['p50_ms']} | {r['p95_ms']} | {r['lines_per_call']} "
            f"| {r['requests']} |"
        )
    lines.append(f"throughput with {result['loads'][1]['clients']} clients: {result['speedup']}x one client's")
    return "\n".join(lines)
