"""``make serve ARGS="name=<run>"``: load the run, bind ``serve.host``:``serve.port``, say what was loaded and
where to open it (one line each), and serve until Ctrl-C."""

from __future__ import annotations

import errno
import socket

import uvicorn

from app.config.schema import Config
from app.run.errors import UserError
from app.serve.engine import load_engine
from app.serve.routes import create_app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a free port); one in use, or a host that is not this
    machine's, is a UserError naming the setting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UserError(f"serve.port={port}: in use on {host}; give another (0: any free port)") from None
        raise UserError(f"serve.host={host}: cannot listen there ({err.strerror or err})") from None
    sock.listen(128)
    return sock


def check_settings(cfg: Config) -> None:
    """decode.beam_size (a request's default beam) within serve.max_beam, else a UserError (checked before the run
    loads; each serve.* setting alone is checked as it is composed, ServeConfig)."""
    beam, most = cfg.decode.beam_size, cfg.serve.max_beam
    if beam > most:
        raise UserError(
            f"decode.beam_size={beam} is above serve.max_beam={most}: every request without a beam_size would be "
            "refused; give decode.beam_size within serve.max_beam, or raise serve.max_beam"
        )


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def serve(cfg: Config) -> None:
    if cfg.decode.sampling:  # a page's request is its beam_size's search, ranked and scored
        raise UserError(
            "decode.sampling=true: make serve does not sample (make translate and make eval do); leave it out"
        )
    if cfg.decode.mbr_candidates:  # nor chooses among candidates: a request's beam size and n-best are its own
        raise UserError(
            f"decode.mbr_candidates={cfg.decode.mbr_candidates}: make serve decodes each request as it asks (beam "
            "size, n-best); minimum Bayes risk decoding is make translate's and make eval's: leave it out"
        )
    check_settings(cfg)
    engine = load_engine(cfg)  # a run that does not load fails before the port is taken
    sock = bind(cfg.serve.host, cfg.serve.port)
    app = create_app(engine, cfg.serve, cfg.decode)
    print(engine.summary(), flush=True)
    print(f"open {url(sock)} (API: POST /translate, GET /health, GET /info; Ctrl-C stops it)", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
