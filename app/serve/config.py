"""The ``serve.*`` settings (a part of the schema in app/config.py, kept beside the server they steer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # only this machine; 0.0.0.0 answers every interface (no authentication: mind it)
    port: int = 8000  # 0: any free port (the line printed at start names it)
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN (translate.engine=ct2: the export instead)
    batch_wait_ms: float = 20.0  # how long a batch waits for requests to join it (from the first, or the last answers)
    max_batch_lines: int = 256  # lines of one decoding call at most (decode.batch_tokens splits it further)
    max_lines: int = 64  # lines of one request at most
    max_chars: int = 2000  # characters of one line at most
    max_beam: int = 16  # beam_size of a request at most
    # make bench ARGS="name=<run> bench.serve=true": concurrent clients, each sending single sentences
    bench_clients: int = 16
    bench_seconds: float = 20.0  # how long each of the two loads (1 client, bench_clients clients) runs
