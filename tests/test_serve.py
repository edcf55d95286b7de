"""make serve: the batcher and the API's refusals in-process (an engine that only counts, so these run in
seconds), then a tiny run trained through the real CLI and served by ``python -m app command=serve`` in a
subprocess, talked to over HTTP; an out-of-memory error injected into its decoding; its page in Chromium."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import uvicorn
from conftest import REPO, run_cli, trained_tiny_run

from app.bench.serving import request
from app.config.commands import DecodeConfig, ServeConfig
from app.serve.batcher import RequestBatcher
from app.serve.messages import TranslateResponse
from app.serve.routes import create_app

POISON = "POISON"  # a line the engines below cannot decode: out of memory


# ---- the batcher ----
def test_concurrent_requests_share_one_decoding_call_grouped_by_key():
    calls = []

    def decode(sources, key):
        calls.append((key, list(sources)))
        return [f"{key}:{s}" for s in sources]

    async def main():
        batcher = RequestBatcher(decode, wait_s=0.2, max_lines=100)
        batcher.start()
        jobs = [batcher.submit([f"a{i}", f"b{i}"], "greedy" if i % 3 else "beam") for i in range(9)]
        results = await asyncio.gather(*jobs)
        await batcher.stop()
        return results

    results = asyncio.run(main())
    assert [(c[0], len(c[1])) for c in calls] == [("beam", 6), ("greedy", 12)]  # 9 requests: one call per key
    for i, result in enumerate(results):  # each request gets its own lines back, in order
        key = "greedy" if i % 3 else "beam"
        assert result == [f"{key}:a{i}", f"{key}:b{i}"]


def test_out_of_memory_refuses_only_the_request_that_does_not_fit():
    calls = []

    def decode(sources, key):
        calls.append(len(sources))
        if POISON in sources:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return [s.lower() for s in sources]

    async def main():
        batcher = RequestBatcher(decode, wait_s=0.2, max_lines=100)
        batcher.start()
        jobs = [batcher.submit(["A", "B"], 1), batcher.submit([POISON], 1), batcher.submit(["C"], 1)]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        after = await batcher.submit(["D"], 1)  # the batcher goes on
        await batcher.stop()
        return results, after

    results, after = asyncio.run(main())
    assert results[0] == ["a", "b"] and results[2] == ["c"] and after == ["d"]
    assert isinstance(results[1], torch.OutOfMemoryError)
    assert calls == [4, 2, 1, 1, 1]  # together, then each request alone, then the next one


def test_max_lines_closes_a_batch_early():
    calls = []

    async def main():
        batcher = RequestBatcher(lambda s, k: calls.append(len(s)) or s, wait_s=0.5, max_lines=4)
        batcher.start()
        start = time.monotonic()
        await asyncio.gather(*[batcher.submit([i, i], 0) for i in range(2)])
        await batcher.stop()
        return time.monotonic() - start

    assert asyncio.run(main()) < 0.4 and calls == [4]  # full: decoded without waiting out wait_s


def test_a_request_that_would_overfill_a_batch_is_the_next_ones_first():
    """No decoding call holds more than max_lines lines (serve.max_batch_lines): three requests of 3 lines under a
    cap of 4 are three calls, each request whole and answered with its own lines (a call of 6 before)."""
    calls = []

    async def main():
        batcher = RequestBatcher(lambda s, k: calls.append(len(s)) or s, wait_s=0.2, max_lines=4)
        batcher.start()
        results = await asyncio.gather(*[batcher.submit([i] * 3, 0) for i in range(3)])
        await batcher.stop()
        return results

    assert asyncio.run(main()) == [[0] * 3, [1] * 3, [2] * 3] and calls == [3, 3, 3]


# ---- the API in-process, with an engine that only counts ----
class CountingEngine:
    """Stands in for app.serve.engine.Engine: a line's "translation" is its length."""

    info = {"run": "counting", "engine": "none", "step": 0, "model": {"arch": "none"}, "parameters": 0, "device": "cpu"}
    trained = None  # no checkpoint, as a CTranslate2 export: no constrained decoding

    def __init__(self):
        self.calls = 0

    def encode(self, texts):
        return list(texts)

    def translate(
        self, src, beam_size, n_best, attention, self_attention=False, no_repeat_ngram_size=0, *forced, lines=None
    ):
        self.calls += 1
        self.lines = lines
        if POISON in src:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        hyp = lambda s, k: {"text": str(len(s) + k), "score": -float(k), "target_pieces": [s]}  # noqa: E731
        return [{"source_pieces": [s], "hypotheses": [hyp(s, k) for k in range(n_best)]} for s in src]

    def encode_targets(self, texts, what="translation"):
        return list(texts)

    def score(self, src, tgt, attention, self_attention=False, lines=None):
        self.calls += 1
        self.lines = lines
        return [
            {"source_pieces": [s], "hypotheses": [{"text": t, "score": -1.0, "target_pieces": [t]}]}
            for s, t in zip(src, tgt)
        ]


class InThread:
    """An application served by uvicorn on a free port of 127.0.0.1, on a thread of this process."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


LIMITS = ServeConfig(max_lines=3, max_chars=50, max_beam=6, batch_wait_ms=50)


@pytest.fixture(scope="module")
def counting_server():
    engine = CountingEngine()
    server = InThread(create_app(engine, LIMITS, DecodeConfig()))
    yield server.port, engine
    server.close()


def raw(port: int, body: bytes | None, path="/translate", method="POST", content_type="application/json", chunk=0):
    """``body`` None: a request with no body and no Content-Type; ``chunk``: the body sent in pieces of that many
    bytes (Transfer-Encoding: chunked, no Content-Length)."""
    connection = __import__("http.client").client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {} if body is None or content_type is None else {"Content-Type": content_type}
    if chunk:
        pieces = (body[i : i + chunk] for i in range(0, len(body), chunk))
        connection.request(method, path, body=pieces, headers=headers, encode_chunked=True)
    else:
        connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    return response.status, text


KNOWN = "(known: text, beam_size, n_best, attention, self_attention, no_repeat_ngram_size, translation, prefix, "
KNOWN += "constraints)"
SEND = 'send a JSON object with "text" (a string or a list of strings), e.g. {"text": "Hola"}'
PAIR = "a character's surrogate escapes come in a pair, e.g. \\ud83d\\ude00)"

# (body, None for none; status; the error's start): every refusal is one JSON line naming what is wrong; a body the
# schema refuses names every unknown field, every missing one and every wrong type, none left out
BAD_INPUT = [
    (b'{"text": ["Hola"', 400, "malformed JSON: Expecting ',' delimiter (at character 16)"),
    (b"not json at all", 400, "malformed JSON: Expecting value (at character 0)"),
    (None, 422, f"no body: {SEND}"),
    (b"", 422, f"no body: {SEND}"),
    (b'["Hola"]', 422, f"the body is a JSON array, not an object: {SEND}"),
    (b'"Hola"', 422, f"the body is a JSON string, not an object: {SEND}"),
    (b"null", 422, f"the body is JSON null, not an object: {SEND}"),
    (b"{}", 422, 'missing field "text" (a string or a list of strings)'),
    (b'{"txt": "Hola"}', 422, f'unknown field "txt" {KNOWN}; missing field "text" (a string or a list of strings)'),
    (b'{"text": "a", "beam": 2, "nbest": 1}', 422, f'unknown fields "beam", "nbest" {KNOWN}'),
    (b'{"text": 5}', 422, 'wrong type: "text" should be a string or a list of strings (got 5)'),
    (b'{"text": []}', 422, "text: give a line to translate"),
    (b'{"text": ""}', 422, "text[0]: an empty line"),
    (b'{"text": ["Hola", "  "]}', 422, "text[1]: an empty line"),
    (b'{"text": ["Hola", 5]}', 422, 'wrong type: "text[1]" should be a string (got 5)'),
    (b'{"text": null}', 422, 'wrong type: "text" should be a string or a list of strings (got null)'),
    (b'{"text": ["a", "b", "c", "d"]}', 413, "text: 4 lines; at most 3 a request (serve.max_lines)"),
    (json.dumps({"text": ["x" * 51]}).encode(), 413, "text[0]: 51 characters; at most 50 a line (serve.max_chars)"),
    (b'{"text": "Hola", "beam_size": 0}', 422, "beam_size: 0; choose 1 to 6 (serve.max_beam)"),
    (b'{"text": "Hola", "beam_size": 7}', 422, "beam_size: 7; choose 1 to 6"),
    (b'{"text": "Hola", "beam_size": "5"}', 422, 'wrong type: "beam_size" should be an integer or null (got "5")'),
    (b'{"text": "Hola", "beam_size": 2.5}', 422, 'wrong type: "beam_size" should be an integer or null (got 2.5)'),
    (b'{"text": "Hola", "beam_size": 2, "n_best": 3}', 422, "n_best: 3; choose 1 to beam_size (2)"),
    (b'{"text": "Hola", "n_best": 0}', 422, "n_best: 0"),
    (b'{"text": "Hola", "attention": "yes"}', 422, 'wrong type: "attention" should be true or false (got "yes")'),
    (b'{"text": "Hola", "no_repeat_ngram_size": -1}', 422, "no_repeat_ngram_size: -1; choose 0 (no ban) or more"),
    (b'{"text": "Hola", "beam": 5}', 422, f'unknown field "beam" {KNOWN}'),
    (
        b'{"n_best": "2", "txt": "Hola", "attention": 1}',
        422,
        f'unknown field "txt" {KNOWN}; missing field "text" (a string or a list of strings); wrong type: "n_best" '
        'should be an integer (got "2"); wrong type: "attention" should be true or false (got 1)',
    ),
    (b'{"text": ["Hola", "Adios"], "translation": "Hello"}', 422, "translation: 1 for 2 lines of text; give one"),
    (b'{"text": "Hola", "translation": ["a", "b"]}', 422, "translation: 2 for 1 lines of text"),
    (b'{"text": "Hola", "translation": "Hi", "n_best": 2}', 422, "n_best: 2; a given translation is scored, not"),
    (
        json.dumps({"text": "Hola", "translation": "x" * 51}).encode(),
        413,
        "translation[0]: 51 characters; at most 50 a line (serve.max_chars)",
    ),
    (
        b'{"text": "Hola", "translation": 5}',
        422,
        'wrong type: "translation" should be a string, a list of strings or null (got 5)',
    ),
    (b'{"text": ["Hola", "Adios"], "prefix": ["In"]}', 422, "prefix: 1 for 2 lines of text; give one prefix a line"),
    (b'{"text": "Hola", "prefix": "x", "translation": "y"}', 422, "prefix: a given translation is scored whole"),
    (
        json.dumps({"text": "Hola", "prefix": "x" * 51}).encode(),
        413,
        "prefix[0]: 51 characters; at most 50 a line (serve.max_chars)",
    ),
    (b'{"text": ["Hola", "Adios"], "constraints": [["x"]]}', 422, "constraints: 1 for 2 lines of text; give one list"),
    (
        b'{"text": "Hola", "constraints": [["x"]], "translation": "y"}',
        422,
        "constraints: a given translation is scored",
    ),
    (b'{"text": "Hola", "constraints": [["God", " "]]}', 422, "constraints[0][1]: an empty phrase; give its words"),
    (
        json.dumps({"text": "Hola", "constraints": [["x" * 51]]}).encode(),
        413,
        "constraints[0][0]: 51 characters; at most 50 a phrase (serve.max_chars)",
    ),
    (
        b'{"text": "Hola", "constraints": "God"}',
        422,
        'wrong type: "constraints" should be a list of lists of strings or null (got "God")',
    ),
    (b'{"text": "Hola", "constraints": ["God"]}', 422, 'wrong type: "constraints[0]" should be a list (got "God")'),
    (
        b'{"text": "Hola", "constraints": [["God", 5]]}',
        422,
        'wrong type: "constraints[0][1]" should be a string (got 5)',
    ),
    (b'{"text": "Hola", "constraints": [["God"]]}', 422, "constraints: the CTranslate2 export has no constrained"),
    (json.dumps({"text": ["x" * 40] * 3, "pad": "y" * 10_000_000}).encode(), 413, "a body of"),  # 10 MB
    (
        json.dumps({"text": "Hola", "constraints": [["x" * 30, "y" * 30]]}).encode(),
        413,
        "constraints[0]: 60 characters in its phrases; at most 50 a line (serve.max_chars)",
    ),
    # JSON's escape of half a character (a lone surrogate) parses, but is no text: named, in every field of text
    (
        b'{"text": ["Hola", "a\\ud800"]}',
        422,
        f"text[1]: not valid Unicode text (a lone surrogate \\ud800 at character 1; {PAIR}",
    ),
    (
        b'{"text": "Hola", "translation": "\\udfff"}',
        422,
        "translation[0]: not valid Unicode text (a lone surrogate \\udfff",
    ),
    (b'{"text": "Hola", "prefix": "\\ud800"}', 422, "prefix[0]: not valid Unicode text (a lone surrogate \\ud800"),
    (
        b'{"text": "Hola", "constraints": [["God", "\\ud800"]]}',
        422,
        "constraints[0][1]: not valid Unicode text (a lone surrogate \\ud800",
    ),
    (b'{"text": "Hola", "\\ud800": 1}', 422, "a field's name: not valid Unicode text (a lone surrogate \\ud800"),
    (
        b'{"text": "Hola", "beam_size": "\\ud800"}',
        422,
        'wrong type: "beam_size" should be an integer or null (got "\\ud800")',
    ),
    # bytes that are not UTF-8, nesting deeper than the JSON parser goes
    (b'{"text": "Hola \xff"}', 400, "malformed JSON: not valid UTF-8 (at byte 15)"),
    (b'{"text": ' + b"[" * 20_000, 400, "malformed JSON: nested too deep to read"),
]


@pytest.mark.slow
def test_a_serve_bench_of_a_run_that_is_not_there_says_so_in_one_line(tmp_path):
    """The server process ends on its own after its one-line error (a signal then printed a traceback)."""
    result = run_cli(tmp_path, "command=bench", "name=nosuchrun", "bench.serve=true")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (
        result.stderr.strip()
        == "error: checkpoints/nosuchrun/best.pt: checkpoint not found (train first, or check name=)"
    )


@pytest.mark.parametrize("body,status,message", BAD_INPUT, ids=[m for _, _, m in BAD_INPUT])
def test_bad_input_is_a_clear_4xx_and_the_server_goes_on(counting_server, body, status, message):
    port, _ = counting_server
    got, text = raw(port, body)
    assert got == status, text
    answer = json.loads(text)
    assert list(answer) == ["error"] and answer["error"].startswith(message), answer
    assert "\n" not in answer["error"] and "Traceback" not in text
    assert request(port, "GET", "/health") == (200, {"status": "ok"})
    assert request(port, "POST", "/translate", {"text": "Hola"})[0] == 200


def test_a_json_body_sent_as_other_content_says_so(counting_server):
    port, _ = counting_server
    for content_type in ("text/plain", None):
        got, text = raw(port, b'{"text": "Hola"}', content_type=content_type)
        assert (got, json.loads(text)) == (
            422,
            {"error": "the body was not read as JSON: send it with Content-Type: application/json"},
        )


def test_a_body_within_the_limits_is_read_however_json_escapes_its_text():
    """The body limit lets through the largest body serve.max_lines and serve.max_chars allow (default limits):
    lines of emoji in every field of text a request can carry together, as json.dumps writes them (each emoji a
    12-byte surrogate pair escape, \\ud83d\\ude00), and refuses a body of 10 MB."""
    limits = ServeConfig()
    server = InThread(create_app(CountingEngine(), limits, DecodeConfig()))
    try:
        lines = ["\U0001f600" * limits.max_chars] * limits.max_lines
        scored = json.dumps({"text": lines, "translation": lines}).encode()
        status, text = raw(server.port, scored)
        assert status == 200 and len(json.loads(text)["translations"]) == limits.max_lines, text[:300]
        phrases = [["\U0001f600"] * limits.max_chars] * limits.max_lines  # a line's phrases: max_chars together
        constrained = json.dumps({"text": lines, "prefix": lines, "constraints": phrases}).encode()
        status, text = raw(server.port, constrained)
        # read and checked whole: refused only for the engine (an export's, which has no constrained decoding)
        assert (status, json.loads(text)) == (
            422,
            {"error": "constraints: the CTranslate2 export has no constrained decoding"},
        )
        status, text = raw(server.port, json.dumps({"text": "Hola", "pad": "y" * 10_000_000}).encode())
        assert status == 413 and json.loads(text)["error"].startswith("a body of 10000"), text
    finally:
        server.close()


def test_a_body_sent_in_chunks_is_held_to_the_same_limit(counting_server):
    """A body with no Content-Length is counted as it arrives: refused once past the limit (it had been read
    whole, 10 MB, then refused for its unknown field), and read whole, as one, when within it."""
    port, _ = counting_server
    limit = LIMITS.max_lines * (2 * (12 * 50 + 16) + 20 * 50 + 16) + 65536  # max_body_bytes(LIMITS)
    big = json.dumps({"text": "Hola", "pad": "y" * 10_000_000}).encode()
    status, text = raw(port, big, chunk=65536)
    assert (status, json.loads(text)) == (
        413,
        {
            "error": f"a body of more than {limit} bytes (sent in chunks); at most {limit} (serve.max_lines x "
            "serve.max_chars)"
        },
    )
    body = json.dumps({"text": ["Hola", "mundo"], "beam_size": 2}).encode()
    status, text = raw(port, body, chunk=7)
    assert status == 200 and len(json.loads(text)["translations"]) == 2, text
    assert raw(port, b'{"text": ' + b" " * (limit - 9), chunk=4096)[0] == 400  # at the limit: read, then parsed
    assert raw(port, b'{"text": ' + b" " * (limit - 8), chunk=4096)[0] == 413  # a byte over


def test_unknown_paths_and_methods_are_json_errors(counting_server):
    port, _ = counting_server
    assert raw(port, b"", "/nowhere", "GET") == (404, json.dumps({"error": "Not Found"}, separators=(",", ":")))
    assert raw(port, b"", "/translate", "GET")[0] == 405
    assert raw(port, b"", "/static/secret.py", "GET")[0] == 404


def test_an_out_of_memory_request_is_answered_with_503_and_the_others_are_served(counting_server):
    port, engine = counting_server
    bodies = [{"text": ["uno", "dos"]}, {"text": [POISON]}, {"text": "tres"}]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda b: request(port, "POST", "/translate", b), bodies))
    assert answers[1][0] == 503 and answers[1][1]["error"].startswith("out of memory on the device")
    assert answers[0][0] == answers[2][0] == 200
    assert [t["hypotheses"][0]["text"] for t in answers[0][1]["translations"]] == ["3", "3"]
    assert request(port, "POST", "/translate", {"text": "cuatro", "n_best": 2, "beam_size": 2})[0] == 200


def test_concurrent_clients_are_batched_and_each_gets_its_own_lines(counting_server):
    port, engine = counting_server
    before = request(port, "GET", "/info")[1]["decoded"]
    lines = [f"line {'x' * i}" for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda line: request(port, "POST", "/translate", {"text": line}), lines))
    after = request(port, "GET", "/info")[1]["decoded"]
    for line, (status, answer) in zip(lines, answers):
        assert status == 200 and answer["translations"][0]["source_pieces"] == [line]
        TranslateResponse.model_validate(answer)
    assert after["lines"] - before["lines"] == 16
    assert after["calls"] - before["calls"] <= 8  # 16 requests, at most half as many calls


def test_each_line_reaches_the_engine_with_its_text(counting_server):
    """The text of every line travels with its ids through the batcher: the words the attention's links number."""
    port, engine = counting_server
    lines = ["uno dos", "tres"]
    assert request(port, "POST", "/translate", {"text": lines})[0] == 200
    assert engine.lines == lines
    assert request(port, "POST", "/translate", {"text": lines, "translation": ["one two", "three"]})[0] == 200
    assert engine.lines == lines


def test_the_links_number_the_words_of_the_line_as_typed(nfkc_tokenizer):
    """A ZWNJ inside a Persian word is one word of the line, which the normalization turns into a word boundary
    (▁): read from the decoded ids, the pieces after it were numbered as the next word, and every link to them
    named a word the line does not have there."""
    from app.decode.search import Hypotheses
    from app.serve.engine import Engine

    text, translation = "mi\u200cxahm ketab ra bexanam", "i want to read the book"
    src, tgt = nfkc_tokenizer.encode_src([text]), nfkc_tokenizer.encode_tgt([translation])
    typed, decoded = nfkc_tokenizer.src_words([text])[0], nfkc_tokenizer.decoded_src_words(src)[0]
    column = next(i for i, (a, b) in enumerate(zip(typed, decoded)) if a != b)  # a piece after the ZWNJ
    assert typed[column] == 0 and decoded[column] == 1
    weights = torch.zeros(len(tgt[0]) + 1, len(src[0]) + 1)
    weights[:, column] = 1.0  # every target piece attends to it

    class Translator:
        def translate(self, src, decode, need_attention=False, prefix=None, constraints=None):
            return Hypotheses([tgt[0]], [weights], [[(tgt[0], -1.0)]])

    engine = Engine(Translator(), nfkc_tokenizer, DecodeConfig(), {})
    links = engine.translate(src, 1, 1, True, lines=[text])[0]["attention"]["hypotheses"][0]["links"]
    assert links and {s for view in links for s, _ in view} == {0}


# ---- a tiny run through the real CLI, served by it ----
pytest_slow = pytest.mark.slow
LINES = ["En el principio creó Dios los cielos y la tierra.", "Y dijo Dios: Sea la luz.", "Y fue la tarde."]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus_tsv):
    return trained_tiny_run(tmp_path_factory, corpus_tsv, "serve")


class Served:
    """``python -m app command=serve ...`` in a subprocess; ``url`` from the line it prints."""

    def __init__(self, cwd, *args):
        env = {**os.environ, "PYTHONPATH": REPO, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app", "command=serve", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines = []
        deadline = time.monotonic() + 120
        while not any(line.startswith("open http") for line in self.lines):
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"make serve ended: {self.process.wait()} {self.process.stderr.read()[-3000:]}")
            assert time.monotonic() < deadline
            self.lines.append(line.rstrip("\n"))
        self.url = re.search(r"http://[\d.]+:\d+/", self.lines[-1]).group(0)
        self.port = int(self.url.rsplit(":", 1)[1].strip("/"))

    def close(self) -> int:
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()


@pytest.fixture(scope="module")
def served(workdir):
    server = Served(workdir, "name=tiny", "device=cpu", "serve.port=0", "serve.batch_wait_ms=100")
    yield server
    server.close()


@pytest_slow
def test_serve_says_what_it_loaded_and_where_to_open_it_and_answers(served):
    loaded, where = served.lines[-2:]
    assert re.fullmatch(
        r"loaded checkpoints/tiny/best\.pt \(step 40\): transformer, [\d,]+ parameters, engine torch on cpu", loaded
    )
    assert where.startswith("open http://127.0.0.1:")
    assert request(served.port, "GET", "/health") == (200, {"status": "ok"})
    status, info = request(served.port, "GET", "/info")
    assert status == 200 and (info["run"], info["engine"], info["device"]) == ("tiny", "torch", "cpu")
    assert info["model"]["d_model"] == 32 and info["parameters"] > 0 and info["defaults"]["beam_size"] == 5
    assert info["defaults"]["no_repeat_ngram_size"] == 0  # decode.no_repeat_ngram_size's default: no ban
    status, page = raw(served.port, b"", "/", "GET")
    assert status == 200 and "/static/attention_map.js" in page
    status, script = raw(served.port, b"", "/static/attention_map.js", "GET")
    assert status == 200 and "class AttentionMap" in script and "__VIRIDIS__" not in script


@pytest_slow
def test_served_translations_are_make_translates(served, workdir):
    """The same lines through the API and through make translate: the same decoding path, the same output."""
    expected = run_cli(workdir, "command=translate", "name=tiny", "device=cpu", stdin="\n".join(LINES) + "\n")
    assert expected.returncode == 0, expected.stderr[-2000:]
    status, answer = request(served.port, "POST", "/translate", {"text": LINES})
    assert status == 200, answer
    TranslateResponse.model_validate(answer)
    assert [t["hypotheses"][0]["text"] for t in answer["translations"]] == expected.stdout.splitlines()
    nbest = run_cli(workdir, "command=translate", "name=tiny", "device=cpu", "decode.n_best=3", stdin=LINES[1] + "\n")
    status, answer = request(served.port, "POST", "/translate", {"text": LINES[1], "n_best": 3})
    hyps = answer["translations"][0]["hypotheses"]
    assert [f"0 ||| {h['text']} ||| {h['score']:.4f}" for h in hyps] == nbest.stdout.splitlines()
    assert [h["score"] for h in hyps] == sorted((h["score"] for h in hyps), reverse=True)
    greedy = request(served.port, "POST", "/translate", {"text": LINES[1], "beam_size": 1})[1]
    assert greedy["translations"][0]["hypotheses"][0]["score"] is None
    # a request's own n-gram ban, as make translate's decode.no_repeat_ngram_size (the tiny model repeats itself)
    ban = "decode.no_repeat_ngram_size=2"
    banned = run_cli(workdir, "command=translate", "name=tiny", "device=cpu", ban, stdin="\n".join(LINES) + "\n")
    status, answer = request(served.port, "POST", "/translate", {"text": LINES, "no_repeat_ngram_size": 2})
    assert status == 200 and banned.stdout != expected.stdout
    assert [t["hypotheses"][0]["text"] for t in answer["translations"]] == banned.stdout.splitlines()


@pytest_slow
def test_a_given_translation_is_scored_as_make_score_scores_it(served, workdir, tmp_path):
    """``translation``: each line's given translation is its one hypothesis, scored by the teacher-forced pass of make
    score (the same log p), with the attention that read it and the self-attention, as a hypothesis' are."""
    given = ["In the beginning God created the heavens.", "And God said."]
    (tmp_path / "s.es").write_text("".join(line + "\n" for line in LINES[:2]), encoding="utf-8")
    (tmp_path / "t.en").write_text("".join(line + "\n" for line in given), encoding="utf-8")
    files = (f"score.source={tmp_path / 's.es'}", f"score.target={tmp_path / 't.en'}", "score.pieces=true")
    scored = run_cli(workdir, "command=score", "name=tiny", "device=cpu", *files)
    assert scored.returncode == 0, scored.stderr[-2000:]
    body = {"text": LINES[:2], "translation": given, "attention": True, "self_attention": True}
    status, answer = request(served.port, "POST", "/translate", body)
    assert status == 200, answer
    TranslateResponse.model_validate(answer)
    for row, translation, text in zip(scored.stdout.splitlines(), answer["translations"], given):
        total, count, _, pieces = row.split("\t")
        (hypothesis,) = translation["hypotheses"]
        assert hypothesis["text"] == text and hypothesis["score"] == pytest.approx(float(total), abs=2e-3)
        assert len(hypothesis["piece_log_probs"]) == int(count) == len(hypothesis["target_pieces"]) + 1
        assert pieces.split(" ") == [
            f"{p}:{q:.4f}" for p, q in zip(hypothesis["target_pieces"] + ["</s>"], hypothesis["piece_log_probs"])
        ]
        maps = translation["attention"]["hypotheses"][0]
        assert maps["rows"] == hypothesis["target_pieces"] + ["</s>"] and maps["links"] and maps["cells"]
        decoder = translation["self_attention"]["decoder"]["hypotheses"][0]
        assert decoder["columns"] == ["<s>"] + hypothesis["target_pieces"]
    # the model's own translation, scored, has the attention it translated with (rounded to the API's integers)
    own = request(served.port, "POST", "/translate", {"text": LINES[0], "beam_size": 1, "attention": True})[1]
    text = own["translations"][0]["hypotheses"][0]["text"]
    forced = request(served.port, "POST", "/translate", {"text": LINES[0], "translation": text, "attention": True})[1]
    mine, theirs = (a["translations"][0]["attention"]["hypotheses"][0] for a in (own, forced))
    assert mine["rows"] == theirs["rows"]  # the text re-encoded into the same pieces
    assert all(
        abs(a - b) <= 1 for x, y in zip(mine["maps"], theirs["maps"]) for r, q in zip(x, y) for a, b in zip(r, q)
    )
    assert mine["links"] == theirs["links"]


def nbest_rows(answer: dict) -> list[str]:
    """An API answer's hypotheses as make translate's n-best lines."""
    return [
        f"{i} ||| {h['text']} ||| {h['score']:.4f}"
        for i, t in enumerate(answer["translations"])
        for h in t["hypotheses"]
    ]


@pytest_slow
def test_a_prefix_begins_each_hypothesis_as_in_make_translate(served, workdir, tmp_path):
    """``prefix``: the hypotheses of make translate with translate.prefix (the same n-best and scores); the attention
    has the prefix's rows; a line with an empty prefix decodes as without one; refused with a given translation."""
    (tmp_path / "prefix.txt").write_text("In the end\n\n", encoding="utf-8")
    args = (
        "command=translate",
        "name=tiny",
        "device=cpu",
        "decode.n_best=2",
        f"translate.prefix={tmp_path / 'prefix.txt'}",
    )
    expected = run_cli(workdir, *args, stdin="\n".join(LINES[:2]) + "\n")
    assert expected.returncode == 0, expected.stderr[-2000:]
    body = {"text": LINES[:2], "prefix": ["In the end", ""], "n_best": 2, "attention": True}
    status, answer = request(served.port, "POST", "/translate", body)
    assert status == 200, answer
    TranslateResponse.model_validate(answer)
    rows = nbest_rows(answer)
    assert rows == expected.stdout.splitlines() and rows[0].startswith("0 ||| In the end")
    first = answer["translations"][0]
    for hypothesis, maps in zip(first["hypotheses"], first["attention"]["hypotheses"]):
        assert maps["rows"] == hypothesis["target_pieces"] + ["</s>"]
    free = request(served.port, "POST", "/translate", {"text": LINES[1], "n_best": 2})[1]
    assert free["translations"][0]["hypotheses"] == answer["translations"][1]["hypotheses"]


@pytest_slow
def test_constraints_are_met_by_every_hypothesis_as_in_make_translate(served, workdir, tmp_path):
    """``constraints``: the hypotheses of make translate with translate.constraints (the same n-best and scores), each
    containing its line's phrases, with a prefix too; a line with no phrase decodes as without constraints; a phrase
    that is empty after tokenization is refused naming it."""
    (tmp_path / "terms.txt").write_text("the waters\tGod\n\n", encoding="utf-8")
    args = (
        "command=translate",
        "name=tiny",
        "device=cpu",
        "decode.n_best=2",
        f"translate.constraints={tmp_path}/terms.txt",
    )
    expected = run_cli(workdir, *args, stdin="\n".join(LINES[:2]) + "\n")
    assert expected.returncode == 0, expected.stderr[-2000:]
    body = {"text": LINES[:2], "constraints": [["the waters", "God"], []], "n_best": 2, "attention": True}
    status, answer = request(served.port, "POST", "/translate", body)
    assert status == 200, answer
    TranslateResponse.model_validate(answer)
    rows = nbest_rows(answer)
    assert rows == expected.stdout.splitlines()
    assert all("the waters" in h["text"] and "God" in h["text"] for h in answer["translations"][0]["hypotheses"])
    free = request(served.port, "POST", "/translate", {"text": LINES[1], "n_best": 2})[1]
    assert free["translations"][0]["hypotheses"] == answer["translations"][1]["hypotheses"]
    both = {"text": LINES[0], "prefix": "And", "constraints": [["light"]], "beam_size": 1}
    hypothesis = request(served.port, "POST", "/translate", both)[1]["translations"][0]["hypotheses"][0]["text"]
    assert hypothesis.startswith("And") and "light" in hypothesis
    status, answer = request(served.port, "POST", "/translate", {"text": LINES[0], "constraints": [["\u200b"]]})
    assert (status, answer["error"]) == (
        422,
        "constraints[0][0]: the phrase '\\u200b' is empty after tokenization; give its words (no phrase: [])",
    )


@pytest_slow
def test_constraints_longer_than_the_model_refuse_only_their_request(served):
    """Phrases that with the prefix take more pieces than the model has positions (model.max_len 1024) are refused
    on their own request, before it is batched: it makes no decoding call, and a request sent beside it (the same
    batch key: prefix and constraints) is answered."""
    # pieces of about one character each: a prefix of 404 characters and a phrase of 899 (within serve.max_chars),
    # each within the model's positions, together beyond them
    prefix, phrase = " ".join(["qz xk wj"] * 45), " ".join(["a1 b2 c3"] * 100)
    long = {"text": LINES[0], "prefix": prefix, "constraints": [[phrase]]}
    good = {"text": LINES[1], "prefix": "And", "constraints": [["light"]]}
    calls = request(served.port, "GET", "/info")[1]["decoded"]["calls"]
    status, answer = request(served.port, "POST", "/translate", long)
    assert status == 422 and re.fullmatch(
        r"constrained translation 1 has \d+ subword tokens; this model takes at most 1023 \(model.max_len=1024\): "
        r"split it",
        answer["error"],
    ), answer
    assert request(served.port, "GET", "/info")[1]["decoded"]["calls"] == calls  # refused before the batcher
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda b: request(served.port, "POST", "/translate", b), [long, good]))
    assert answers[0][0] == 422 and answers[1][0] == 200, answers[1]
    assert answers[1][1]["translations"][0]["hypotheses"][0]["text"].startswith("And")


@pytest_slow
def test_attention_of_every_hypothesis_with_its_views_and_links(served):
    status, answer = request(served.port, "POST", "/translate", {"text": LINES[:2], "n_best": 2, "attention": True})
    assert status == 200, answer
    for translation in answer["translations"]:
        a = translation["attention"]
        assert a["columns"] == translation["source_pieces"] + ["</s>"] and a["scale"] == 255
        assert (a["layers"], a["heads"], a["head_layers"]) == (1, 2, [0])
        assert a["views"] == ["layer 0 head 0", "layer 0 head 1", "layer 0 mean"]
        for hyp, maps in zip(translation["hypotheses"], a["hypotheses"]):
            rows = hyp["target_pieces"] + ["</s>"]
            m = torch.tensor(maps["maps"], dtype=torch.float32)
            assert maps["rows"] == rows and m.shape == (3, len(rows), len(a["columns"]))
            assert (m.sum(-1) - 255).abs().max() <= len(a["columns"]) / 2 + 0.5  # rows sum to 1 (rounded)
            assert torch.allclose(m[2], m[:2].mean(0), atol=1)  # the mean of heads
            words = len(hyp["text"].split())  # the links number the words of the text shown
            for view, links in enumerate(maps["links"]):  # one link per target word: its most attended source word
                assert sorted(t for _, t in links) == list(range(words))
                best = [int(row.argmax()) for row in m[view]]
                for t, s in maps["cells"][view]:
                    assert t < len(rows) - 1 and s < len(a["columns"]) - 1  # a word's piece, never </s>
                assert all(0 <= s < len(a["columns"]) for s in best)


@pytest_slow
def test_self_attention_of_the_encoder_and_of_every_hypothesis(served, workdir, monkeypatch):
    """self_attention: the encoder's maps over the source pieces + EOS, and per hypothesis the decoder's over <s> and
    its pieces (causal), every head and each layer's mean: the model's own weights, computed here in-process from
    the same tokens."""
    from app.data.tokenizer import BOS, EOS
    from app.decode.trained import load_trained

    body = {"text": LINES[:2], "n_best": 2, "attention": True, "self_attention": True}
    status, answer = request(served.port, "POST", "/translate", body)
    assert status == 200, answer
    TranslateResponse.model_validate(answer)
    monkeypatch.chdir(workdir)  # the run's paths are the project's, relative
    trained = load_trained(str(workdir / "checkpoints" / "tiny"), "best", torch.device("cpu"), "serve.checkpoint")
    piece_id = trained.tokenizer.tgt.piece_to_id
    views = ["layer 0 head 0", "layer 0 head 1", "layer 0 mean"]
    for line, translation in zip(LINES, answer["translations"]):
        own, columns = translation["self_attention"], translation["attention"]["columns"]
        assert own["scale"] == 255 and own["encoder"]["views"] == own["decoder"]["views"] == views
        assert (own["encoder"]["layers"], own["encoder"]["heads"], own["encoder"]["head_layers"]) == (1, 2, [0])
        encoder = torch.tensor(own["encoder"]["maps"], dtype=torch.float32) / 255
        assert encoder.shape == (3, len(columns), len(columns))
        src = torch.tensor([trained.tokenizer.encode_src([line])[0] + [EOS]])
        for hyp, decoder in zip(translation["hypotheses"], own["decoder"]["hypotheses"]):
            assert decoder["columns"] == ["<s>"] + hyp["target_pieces"]
            maps = torch.tensor(decoder["maps"], dtype=torch.float32) / 255
            assert maps.shape == (3, len(hyp["target_pieces"]) + 1, len(decoder["columns"]))
            assert torch.all(torch.triu(maps, 1) == 0)  # causal: no position reads a later input
            expected = trained.model.self_attention(
                src, torch.tensor([[BOS] + [piece_id(p) for p in hyp["target_pieces"]]])
            )
            assert (maps[:2] - expected.decoder[0, 0]).abs().max() <= 1 / 510 + 1e-6
            assert (encoder[:2] - expected.encoder[0, 0]).abs().max() <= 1 / 510 + 1e-6
    plain = request(served.port, "POST", "/translate", {"text": LINES[0], "attention": True})[1]
    assert "self_attention" not in plain["translations"][0]  # only when asked for


@pytest_slow
def test_the_ctranslate2_export_is_served_as_make_translate_decodes_it(workdir, served):
    """translate.engine=ct2: the run's export (make export) behind the same API, its best hypotheses those of
    make translate with the same engine, its attention the export's one map (a layer's mean of heads)."""
    exported = run_cli(workdir, "command=export", "name=tiny", "device=cpu")
    assert exported.returncode == 0, exported.stderr[-2000:]
    expected = run_cli(
        workdir, "command=translate", "name=tiny", "device=cpu", "translate.engine=ct2", stdin="\n".join(LINES) + "\n"
    )
    assert expected.returncode == 0, expected.stderr[-2000:]
    server = Served(workdir, "name=tiny", "device=cpu", "serve.port=0", "translate.engine=ct2")
    try:
        assert "engine ct2" in server.lines[-2]
        status, info = request(server.port, "GET", "/info")
        assert status == 200 and info["engine"] == "ct2"
        body = {"text": LINES, "attention": True, "self_attention": True}
        status, answer = request(server.port, "POST", "/translate", body)
        assert status == 200, answer
        assert [t["hypotheses"][0]["text"] for t in answer["translations"]] == expected.stdout.splitlines()
        for translation in answer["translations"]:
            a = translation["attention"]
            assert a["views"] == ["attention"] and a["hypotheses"][0]["rows"][-1] == "</s>"
            assert translation["self_attention"] is None  # the export returns nothing of it
        (workdir / "prefix.txt").write_text("In the end\n" * len(LINES), encoding="utf-8")
        continued = run_cli(
            workdir,
            "command=translate",
            "name=tiny",
            "translate.engine=ct2",
            "translate.prefix=prefix.txt",
            stdin="\n".join(LINES) + "\n",
        )
        body = {"text": LINES, "prefix": ["In the end"] * len(LINES), "n_best": 1}
        answer = request(server.port, "POST", "/translate", body)[1]
        texts = [t["hypotheses"][0]["text"] for t in answer["translations"]]
        assert texts == continued.stdout.splitlines() and all(t.startswith("In the end") for t in texts)
        status, _ = request(server.port, "POST", "/translate", {"text": "", "beam_size": 5})
        assert status == 422 and request(server.port, "GET", "/health")[0] == 200  # refused, still serving
        for field, value in (("translation", "\ud800"), ("prefix", "\ud800"), ("constraints", [["\ud800"]])):
            status, answer = request(server.port, "POST", "/translate", {"text": "Hola", field: value})
            assert status == 422 and "not valid Unicode text (a lone surrogate \\ud800" in answer["error"], answer
    finally:
        server.close()


@pytest_slow
def test_bad_input_to_the_real_server_then_it_still_translates(served):
    for body, status, message in BAD_INPUT:
        if "serve.max" in message or "1 to 6" in message:
            continue  # the limits above are the in-process ones; the defaults are checked below
        if "CTranslate2" in message:
            continue  # the in-process server's engine is an export's; this one's is torch, which has constraints
        got, text = raw(served.port, body)
        assert got == status and json.loads(text)["error"].startswith(message.split(";")[0]), text
    long = {"text": ["palabra " * 300]}  # 2,400 characters: more than serve.max_chars (2,000)
    assert request(served.port, "POST", "/translate", long)[1]["error"].startswith("text[0]: 2400 characters")
    assert request(served.port, "POST", "/translate", {"text": ["Hola"] * 65})[0] == 413
    assert request(served.port, "POST", "/translate", {"text": "Hola", "beam_size": 17})[0] == 422
    assert request(served.port, "POST", "/translate", {"text": LINES[0]})[0] == 200


@pytest_slow
def test_a_port_in_use_and_sampling_are_one_line_errors(workdir, served):
    result = run_cli(workdir, "command=serve", "name=tiny", "device=cpu", f"serve.port={served.port}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == f"error: serve.port={served.port}: in use on 127.0.0.1; give another (0: any free port)"
    )

    sampling = run_cli(workdir, "command=serve", "name=tiny", "decode.beam_size=1", "decode.sampling=true")
    assert sampling.returncode == 2 and sampling.stderr.strip() == (
        "error: decode.sampling=true: make serve does not sample (make translate and make eval do); leave it out"
    )


@pytest_slow
@pytest.mark.parametrize(
    "setting,message",
    [
        ("serve.port=-1", "serve.port=-1: not a port; give 0 to 65535 (0: any free port)"),
        ("serve.port=70000", "serve.port=70000: not a port; give 0 to 65535 (0: any free port)"),
        ("serve.max_lines=0", "serve.max_lines=0: lines a request may send, at least 1"),
        ("serve.max_chars=0", "serve.max_chars=0: characters a line may have, at least 1"),
        ("serve.max_beam=0", "serve.max_beam=0: the largest beam_size a request may ask for, at least 1"),
        ("serve.max_batch_lines=0", "serve.max_batch_lines=0: lines of one decoding call, at least 1"),
        (
            "serve.batch_wait_ms=-1",
            "serve.batch_wait_ms=-1.0: how long a batch waits for requests, 0 or more (finite)",
        ),
        (  # a lone request would wait for ever for others to join it
            "serve.batch_wait_ms=inf",
            "serve.batch_wait_ms=inf: how long a batch waits for requests, 0 or more (finite)",
        ),
        (
            "serve.max_batch_lines=32",
            "serve.max_lines=64 is above serve.max_batch_lines=32: a request's lines are decoded in one call; raise "
            "serve.max_batch_lines or lower serve.max_lines",
        ),
        (  # 0 ran the one-client load, then said no request was answered; -1 hung (a barrier of no threads)
            "serve.bench_clients=0",
            "serve.bench_clients=0: concurrent clients of make bench's serving load, at least 1",
        ),
        ("serve.bench_seconds=0", "serve.bench_seconds=0.0: how long each serving load runs, more than 0 (finite)"),
        (
            "decode.beam_size=20",
            "decode.beam_size=20 is above serve.max_beam=16: every request without a beam_size would be refused; "
            "give decode.beam_size within serve.max_beam, or raise serve.max_beam",
        ),
    ],
)
def test_settings_a_server_cannot_work_with_stop_it_before_the_run_loads(tmp_path, setting, message):
    """No run in the folder: the settings are refused before loading it would fail."""
    result = run_cli(tmp_path, "command=serve", "name=nosuchrun", "device=cpu", setting)
    assert (result.returncode, result.stderr.strip(), result.stdout) == (2, f"error: {message}", "")


@pytest_slow
def test_out_of_memory_in_the_real_decoding_path_is_answered_and_serving_goes_on(workdir, monkeypatch):
    """torch.OutOfMemoryError raised from the project's decoding function (app.decode.trained.decode_corpus) for a
    batch holding one poisoned line: that request gets 503, the requests decoded beside it get their answers."""
    from conftest import compose_config

    import app.decode.trained
    from app.serve.engine import load_engine

    monkeypatch.chdir(workdir)
    cfg = compose_config("name=tiny", "device=cpu", "serve.batch_wait_ms=200", command="serve")
    engine = load_engine(cfg)
    poison = engine.tokenizer.encode_src([POISON])[0]
    real = app.decode.trained.decode_corpus

    def decode_corpus(model, src, *args, **kwargs):
        if poison in src:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        return real(model, src, *args, **kwargs)

    monkeypatch.setattr(app.decode.trained, "decode_corpus", decode_corpus)
    server = InThread(create_app(engine, cfg.serve, cfg.decode))
    try:
        bodies = [{"text": LINES[0]}, {"text": POISON}, {"text": LINES[1:]}]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda b: request(server.port, "POST", "/translate", b), bodies))
        assert answers[1] == (
            503,
            {
                "error": "out of memory on the device while decoding this request: send fewer "
                "or shorter lines, or a smaller beam_size"
            },
        )
        assert answers[0][0] == answers[2][0] == 200 and len(answers[2][1]["translations"]) == 2
        assert request(server.port, "GET", "/health") == (200, {"status": "ok"})
        assert request(server.port, "POST", "/translate", {"text": LINES[2], "attention": True})[0] == 200
    finally:
        server.close()


def test_decode_settings_of_a_request_are_the_runs_with_its_beam(monkeypatch):
    """The engine decodes with the run's decode.* settings, beam_size and n_best replaced by the request's."""
    from app.serve.engine import Engine

    seen = []

    class Translator:
        def translate(self, src, decode, need_attention=False, prefix=None, constraints=None):
            seen.append((decode, need_attention))
            from app.decode.search import Hypotheses

            return Hypotheses([[4] for _ in src], None, [[([4], -1.0)] for _ in src])

    class Tokenizer:
        encode_src = staticmethod(lambda texts: [[5] for _ in texts])
        decode_tgt = staticmethod(lambda ids: ["x" for _ in ids])
        src_pieces = tgt_pieces = staticmethod(lambda ids: [str(i) for i in ids])

    engine = Engine(Translator(), Tokenizer(), DecodeConfig(length_penalty=0.6, max_len_extra=3), {})
    out = engine.translate([[5]], 3, 2, False)
    decode, need = seen[0]
    assert (decode.beam_size, decode.n_best, decode.length_penalty, decode.max_len_extra, need) == (3, 2, 0.6, 3, False)
    assert out == [{"source_pieces": ["5"], "hypotheses": [{"text": "x", "score": -1.0, "target_pieces": ["4"]}]}]


# ---- the page in Chromium ----
@pytest.fixture(scope="module")
def browser():
    from browser import Browser, find_chromium

    if find_chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    with Browser(1280, 1800) as b:  # tall: the map below the text box and the hypotheses
        yield b


def translate_on_page(
    b, server, text: str, beam: int = 5, n_best: int = 1, ngram: int = 0, given: str = "", complete: bool = False
) -> None:
    b.open_url(server.url, "window.pageLoaded")
    b.evaluate(
        f"(() => {{ $('text').value = {json.dumps(text)}; $('beam').value = {beam}; $('nbest').value = {n_best};"
        f" $('ngram').value = {ngram}; $('reference').value = {json.dumps(given)};"
        f" $('complete').checked = {json.dumps(complete)}; window.serveReady = undefined; }})()"
    )
    b.click(*b.center("#go"))
    b.wait_for("window.serveReady || window.serveError", timeout=60)
    assert not b.evaluate("window.serveError"), b.evaluate("window.serveError")


@pytest_slow
def test_the_page_draws_no_colour_bar_before_its_first_map(served, browser):
    """The map's colour scale comes with the first map: none on the fresh page, nor after a refusal, then drawn."""
    b = browser
    shown = "(() => Object.fromEntries(['attention-map', 'scale', 'bar', 'legend'].map(id => [id,"
    shown += " document.getElementById(id).checkVisibility()])))()"
    none = {"attention-map": False, "scale": False, "bar": False, "legend": False}
    b.open_url(served.url, "window.pageLoaded")
    assert b.evaluate(shown) == none
    b.evaluate("(() => { $('text').value = 'Hola'; $('beam').value = 99; window.serveError = undefined; })()")
    b.click(*b.center("#go"))
    b.wait_for("window.serveError")
    assert b.evaluate(shown) == none
    translate_on_page(b, served, LINES[0])
    assert b.evaluate(shown) == {"attention-map": True, "scale": True, "bar": True, "legend": True}
    assert b.evaluate("document.getElementById('bar').getBoundingClientRect().height") >= 120


@pytest_slow
def test_the_page_scores_your_translation_and_draws_the_attention_that_read_it(served, browser):
    from test_explorer import texts

    b, given = browser, ["In the beginning God created the heavens.", "And God said."]
    translate_on_page(b, served, "\n".join(LINES[:2]), given="\n".join(given))
    body = {"text": LINES[:2], "translation": given, "attention": True, "self_attention": True}
    answer = request(served.port, "POST", "/translate", body)[1]
    first = answer["translations"][0]["hypotheses"][0]
    assert texts(b, "#results .hyp .text") == given
    assert texts(b, "#results .hyp .score")[0] == f"log p {first['score']:.3f}"
    title = texts(b, "#title")[0]
    least = min(range(len(first["piece_log_probs"])), key=first["piece_log_probs"].__getitem__)
    piece = (first["target_pieces"] + ["</s>"])[least]
    assert title.startswith("line 1, your translation") and f"least expected: {piece} (" in title
    assert texts(b, "#ylabels .tok") == answer["translations"][0]["attention"]["hypotheses"][0]["rows"]
    assert texts(b, "#maps button") == ["cross", "encoder self", "decoder self"]
    # the second line's translation; then a count that does not match the lines is said, and nothing is sent
    b.click(*b.center(".hyp[data-line='1'][data-hyp='0']"))
    b.wait_for("document.getElementById('view').dataset.shown.startsWith('1,0,')")
    assert texts(b, "#ylabels .tok") == answer["translations"][1]["attention"]["hypotheses"][0]["rows"]
    calls = request(served.port, "GET", "/info")[1]["decoded"]["calls"]
    b.evaluate("(() => { $('reference').value = 'Only one.'; })()")
    b.click(*b.center("#go"))
    assert texts(b, "#status") == ["1 translation for 2 lines: give one a line, or none"]
    assert request(served.port, "GET", "/info")[1]["decoded"]["calls"] == calls


@pytest_slow
def test_the_page_continues_your_translation(served, browser):
    """Ticked, the second box's lines are the beginnings the hypotheses continue: the API's answer with ``prefix``."""
    from test_explorer import texts

    b = browser
    translate_on_page(b, served, "\n".join(LINES[:2]), n_best=2, given="In the end\nAnd", complete=True)
    body = {"text": LINES[:2], "prefix": ["In the end", "And"], "n_best": 2, "attention": True, "self_attention": True}
    answer = request(served.port, "POST", "/translate", body)[1]
    hyps = [h["text"] for t in answer["translations"] for h in t["hypotheses"]]
    assert texts(b, "#results .hyp .text") == hyps and hyps[0].startswith("In the end") and hyps[2].startswith("And")
    assert not texts(b, "#results .hyp .score")[0].startswith("log p")  # searched, not scored
    assert texts(b, "#title")[0].startswith("line 1, hypothesis 1")
    assert texts(b, "#ylabels .tok") == answer["translations"][0]["attention"]["hypotheses"][0]["rows"]
    # typing a beginning asks again once typing pauses (no click), the newest answer shown; unticked, typing does not
    b.evaluate("(() => { $('text').value = " + json.dumps(LINES[0]) + "; window.serveReady = undefined; })()")
    for typed in ("In", "In the", "In the end"):
        b.evaluate(f"$('reference').value = {json.dumps(typed)}")
        b.evaluate("$('reference').dispatchEvent(new Event('input'))")
    b.wait_for("window.serveReady", timeout=60)
    assert texts(b, "#results .hyp .text")[0].startswith("In the end") and len(texts(b, "#results .hyp")) == 2
    calls = request(served.port, "GET", "/info")[1]["decoded"]["calls"]
    b.evaluate("(() => { $('complete').checked = false; $('reference').value = 'And'; })()")
    b.evaluate("$('reference').dispatchEvent(new Event('input'))")
    time.sleep(1.0)  # past the page's pause
    assert request(served.port, "GET", "/info")[1]["decoded"]["calls"] == calls


@pytest_slow
def test_the_page_asks_for_the_required_words_of_its_third_box(served, browser):
    """The third box's lines (phrases separated by |; a line left out: none) are the API's constraints: its answer,
    every hypothesis of the first line with both phrases; more lines than sentences are said, and nothing is sent."""
    from test_explorer import texts

    b = browser
    b.open_url(served.url, "window.pageLoaded")
    b.evaluate(
        f"(() => {{ $('text').value = {json.dumps(LINES[0] + chr(10) + LINES[1])}; $('nbest').value = 2;"
        " $('constraints').value = 'the waters | God'; window.serveReady = undefined; })()"
    )
    b.click(*b.center("#go"))
    b.wait_for("window.serveReady || window.serveError", timeout=60)
    assert not b.evaluate("window.serveError"), b.evaluate("window.serveError")
    body = {"text": LINES[:2], "constraints": [["the waters", "God"], []], "n_best": 2, "attention": True}
    answer = request(served.port, "POST", "/translate", {**body, "self_attention": True})[1]
    hyps = [h["text"] for t in answer["translations"] for h in t["hypotheses"]]
    assert texts(b, "#results .hyp .text") == hyps
    assert all("the waters" in h and "God" in h for h in hyps[:2])
    calls = request(served.port, "GET", "/info")[1]["decoded"]["calls"]
    b.evaluate("(() => { $('constraints').value = 'God\\n\\nlight'; })()")
    b.click(*b.center("#go"))
    assert texts(b, "#status") == [
        "3 lines of required words for 2 lines: give at most one a line (an empty line: none)"
    ]
    assert request(served.port, "GET", "/info")[1]["decoded"]["calls"] == calls


@pytest_slow
def test_the_page_translates_and_draws_the_attention_with_the_explorers_code(served, browser):
    from test_explorer import VIRIDIS, cell_center, close, pixel, snapshot, texts

    b = browser
    translate_on_page(b, served, LINES[0] + "\n" + LINES[1], n_best=2)
    body = {"text": LINES[:2], "n_best": 2, "attention": True, "self_attention": True}
    status, answer = request(served.port, "POST", "/translate", body)
    first = answer["translations"][0]
    assert texts(b, "#results .hyp .text") == [
        h["text"] or "(empty)" for t in answer["translations"] for h in t["hypotheses"]
    ]
    assert texts(b, "#xlabels .tok") == first["attention"]["columns"]
    assert texts(b, "#ylabels .tok") == first["attention"]["hypotheses"][0]["rows"]
    assert b.evaluate("document.getElementById('view').dataset.shown") == "0,0,0,mean,cross"  # the last layer, mean
    assert texts(b, "#layers button") == ["0"] and texts(b, "#heads button") == ["mean", "0", "1"]

    def check_pixels(maps):  # every cell in the colour of its weight (the page's copy of the API's maps)
        png = snapshot(b)
        for t, row in enumerate(maps):
            for s, value in enumerate(row):
                assert close(pixel(png, *cell_center(b, t, s)), VIRIDIS[value], 3), (t, s, value)

    check_pixels(first["attention"]["hypotheses"][0]["maps"][2])
    # a head: its own map; hover a cell: its weight in the readout
    b.click(*b.center("#heads button[data-value='1']"))
    b.wait_for("document.getElementById('view').dataset.shown === '0,0,0,1,cross'")
    check_pixels(first["attention"]["hypotheses"][0]["maps"][1])
    b.hover(*cell_center(b, 0, 0))
    weight = first["attention"]["hypotheses"][0]["maps"][1][0][0] / 255
    assert texts(b, "#readout")[0].endswith(f"{weight:.3f}") or "link read from this map" in texts(b, "#readout")[0]

    # the word links read from the map are outlined: red in exactly the cells the API names
    cells = {tuple(c) for c in first["attention"]["hypotheses"][0]["cells"][1]}
    half = b.evaluate("heatmap.cell") // 2
    png = snapshot(b)
    rows, cols = len(first["attention"]["hypotheses"][0]["rows"]), len(first["attention"]["columns"])
    for t in range(rows):
        for s in range(cols):
            x, y = cell_center(b, t, s)
            red = sum(close(pixel(png, x + d, y - half + 2), (255, 45, 85), 40) for d in range(-2, 3))
            assert (red > 0) == ((t, s) in cells), (t, s)

    # the second hypothesis of the second line: its own rows and maps
    b.click(*b.center(".hyp[data-line='1'][data-hyp='1']"))
    b.wait_for("document.getElementById('view').dataset.shown === '1,1,0,1,cross'")
    second = answer["translations"][1]["attention"]["hypotheses"][1]
    assert texts(b, "#ylabels .tok") == second["rows"]
    check_pixels(second["maps"][1])

    # its encoder's self-attention (source over source) and its own decoder self-attention (over <s> and its pieces)
    assert texts(b, "#maps button") == ["cross", "encoder self", "decoder self"]
    own, columns = answer["translations"][1]["self_attention"], answer["translations"][1]["attention"]["columns"]
    b.click(*b.center("#maps button[data-value='encoder']"))
    b.wait_for("document.getElementById('view').dataset.shown === '1,1,0,1,encoder'")
    assert texts(b, "#xlabels .tok") == texts(b, "#ylabels .tok") == columns
    assert texts(b, "#corner") == ["source ↓  source →"]
    check_pixels(own["encoder"]["maps"][1])
    b.click(*b.center("#maps button[data-value='decoder']"))
    b.wait_for("document.getElementById('view').dataset.shown === '1,1,0,1,decoder'")
    assert texts(b, "#xlabels .tok") == own["decoder"]["hypotheses"][1]["columns"]
    assert texts(b, "#ylabels .tok") == second["rows"]
    check_pixels(own["decoder"]["hypotheses"][1]["maps"][1])
    assert "decoder self-attention" in texts(b, "#readout")[0]


@pytest_slow
def test_the_page_shows_a_refusal_and_works_after_it(served, browser):
    b = browser
    b.open_url(served.url, "window.pageLoaded")
    b.evaluate("(() => { $('text').value = 'Hola'; $('beam').value = 99; })()")
    b.click(*b.center("#go"))
    b.wait_for("window.serveError")
    assert texts_of(b, "#status") == ["error 422: beam_size: 99; choose 1 to 16 (serve.max_beam)"]
    b.evaluate("window.serveError = undefined")
    translate_on_page(b, served, LINES[2])
    assert b.evaluate("document.querySelectorAll('#results .hyp').length") == 1
    # the page's n-gram ban is the request's
    translate_on_page(b, served, LINES[2], ngram=2)
    answer = request(served.port, "POST", "/translate", {"text": LINES[2], "no_repeat_ngram_size": 2})[1]
    free = request(served.port, "POST", "/translate", {"text": LINES[2]})[1]
    text = answer["translations"][0]["hypotheses"][0]["text"]
    assert (
        texts_of(b, "#results .hyp .text") == [text or "(empty)"] != [free["translations"][0]["hypotheses"][0]["text"]]
    )


def texts_of(b, selector):
    return b.evaluate(f"[...document.querySelectorAll({json.dumps(selector)})].map(e => e.textContent)")
