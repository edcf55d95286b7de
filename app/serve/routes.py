"""The routes of ``make serve``: the page (``/``, its script and the attention map's drawing code under
``/static/``), ``POST /translate``, ``GET /health`` and ``GET /info``. Every refusal is a JSON ``{"error": "..."}``
of one line with a 4xx status; a failure while decoding answers that request (503 out of memory, 500 otherwise)
and the server goes on."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, NamedTuple

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from app.config.commands import DecodeConfig, ServeConfig
from app.report.explorer import attention_map_script
from app.run.errors import UserError
from app.serve.batcher import RequestBatcher
from app.serve.body_limit import BodyLimit
from app.serve.engine import Engine
from app.serve.messages import RequestError, TranslateRequest, check_request, max_body_bytes
from app.serve.refusals import unreadable_body, validation_message

log = logging.getLogger(__name__)
STATIC = resources.files("app.serve").joinpath("static")
PAGE_FILES = {"page.js": "text/javascript", "page.css": "text/css"}
OUT_OF_MEMORY = (
    "out of memory on the device while decoding this request: send fewer or shorter lines, or a smaller beam_size"
)


def error(status: int, message: str) -> JSONResponse:
    # a lone surrogate the message quotes from the request would not encode as UTF-8: written as its escape
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse({"error": message}, status_code=status)


class Line(NamedTuple):
    """A request's line as the batcher holds it: its source ids and text (whose words the attention's links
    number), and its given pieces (a translation to score, or a prefix) and constraints' phrases, where given."""

    ids: list[int]
    text: str
    given: list[int] = []
    phrases: list[list[int]] = []


def create_app(engine: Engine, limits: ServeConfig, defaults: DecodeConfig) -> FastAPI:
    """The application serving ``engine``; requests batched as ``limits`` (serve.*) says, decoded as ``defaults``
    (decode.*) says where they do not."""

    def decode(sources: list[Line], key: Hashable) -> list[dict[str, Any]]:
        """One call for the lines of a batch: decoded (key: beam size, n-best, attention, self-attention, n-gram
        ban, whether prefixes and whether constraints are given), or their given translations scored (key:
        "score", attention, self-attention)."""
        assert isinstance(key, tuple)  # check_request's
        src, texts = [line.ids for line in sources], [line.text for line in sources]
        if key[0] == "score":
            _, attention, own = key
            return engine.score(src, [line.given for line in sources], attention, own, lines=texts)
        beam, n_best, attention, own, ban, prefixed, constrained = key
        prefix = [line.given for line in sources] if prefixed else None
        phrases = [line.phrases for line in sources] if constrained else None
        return engine.translate(src, beam, n_best, attention, own, ban, prefix, phrases, lines=texts)

    batcher = RequestBatcher(decode, limits.batch_wait_ms / 1000, limits.max_batch_lines)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        batcher.start()
        yield
        await batcher.stop()

    # no /docs: its page loads from a CDN; the schema stays at /openapi.json
    app = FastAPI(title="nmt-attention", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batcher, app.state.engine = batcher, engine
    max_body = max_body_bytes(limits)

    app.add_middleware(
        BodyLimit,
        max_bytes=max_body,
        refuse=lambda message: error(413, message),
        hint=f"at most {max_body} (serve.max_lines x serve.max_chars)",
    )

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return error(*validation_message(err))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        # a body FastAPI could not read as JSON for another reason than its syntax: the cause, said in one line
        return error(*(unreadable_body(err.__cause__) or (err.status_code, str(err.detail))))

    @app.exception_handler(RequestError)
    async def refused(_: Request, err: RequestError) -> JSONResponse:
        return error(err.status, err.message)

    @app.exception_handler(UserError)
    async def user_error(_: Request, err: UserError) -> JSONResponse:
        return error(422, str(err))

    @app.exception_handler(torch.OutOfMemoryError)
    async def out_of_memory(_: Request, err: torch.OutOfMemoryError) -> JSONResponse:
        log.warning("serve: %s", OUT_OF_MEMORY)
        return error(503, OUT_OF_MEMORY)

    @app.exception_handler(Exception)
    async def failed(_: Request, err: Exception) -> JSONResponse:
        log.error("serve: a request failed", exc_info=err)
        first = (str(err).strip().splitlines() or [""])[0]
        return error(500, f"internal error: {type(err).__name__}: {first}"[:300])

    @app.post("/translate")
    async def translate(body: TranslateRequest) -> JSONResponse:
        """Translate ``text`` (a line or a list of lines): per line its hypotheses, best first, with their scores
        and pieces, with ``attention`` each hypothesis' cross-attention (app.serve.engine.attention_entry), with
        ``self_attention`` the encoder's and each hypothesis' decoder's self-attention (self_attention_entry). With
        ``translation``, each line's given translation is its one hypothesis, scored (make score's log p); with
        ``prefix``, each line's hypotheses begin with its prefix; with ``constraints``, they contain its phrases."""
        start = time.monotonic()
        lines, given, key = check_request(body, limits, defaults)
        sources = [Line(ids, text) for ids, text in zip(engine.encode(lines), lines)]
        if given is not None:
            if key[0] == "score" and body.attention and engine.trained is None:
                raise RequestError(422, "attention: the CTranslate2 export scores a translation without attention")
            if key[0] == "score":
                translations = engine.encode_targets(given, "translation")
                sources = [line._replace(given=tgt) for line, tgt in zip(sources, translations)]
        if key[0] != "score" and (key[-2] or key[-1]):  # prefixes or constraints
            if body.constraints is not None and engine.trained is None:
                raise RequestError(422, "constraints: the CTranslate2 export has no constrained decoding")
            prefix = [[]] * len(lines) if given is None else engine.encode_targets(given, "prefix")
            phrases = [[]] * len(lines) if body.constraints is None else engine.encode_constraints(body.constraints)
            if body.constraints is not None:
                engine.check_forced(phrases, prefix)
            sources = [line._replace(given=p, phrases=c) for line, p, c in zip(sources, prefix, phrases)]
        results = await batcher.submit(sources, key)
        return JSONResponse({"translations": results, "seconds": round(time.monotonic() - start, 4)})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/info")
    async def info() -> dict[str, Any]:
        """What is loaded (run, model, parameters, device, engine), the limits and defaults of a request, and the
        decoding calls made so far (lines / calls: how many lines a call decoded on average)."""
        return {
            **engine.info,
            "defaults": {
                "beam_size": defaults.beam_size,
                "n_best": 1,
                "attention": False,
                "self_attention": False,
                "no_repeat_ngram_size": defaults.no_repeat_ngram_size,
            },
            "limits": {
                "max_lines": limits.max_lines,
                "max_chars": limits.max_chars,
                "max_beam": limits.max_beam,
                "batch_wait_ms": limits.batch_wait_ms,
                "max_batch_lines": limits.max_batch_lines,
            },
            "decoded": {"calls": batcher.calls, "lines": batcher.lines},
        }

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(STATIC.joinpath("index.html").read_text(encoding="utf-8"))

    @app.get("/static/attention_map.js")
    async def attention_map() -> Response:  # the explorer's drawing code: one code for both pages
        return Response(attention_map_script(), media_type="text/javascript")

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in PAGE_FILES:
            return error(404, f"/static/{name}: no such file")
        return Response(STATIC.joinpath(name).read_text(encoding="utf-8"), media_type=PAGE_FILES[name])

    return app
