"""make translate on files of any size (app/decode/line_files.py, app/decode/translate.py): a window of lines at a
time, written as it goes, equal to one window of the whole file; an interrupted output (cut mid-line, or a process
killed) continued by translate.resume=true to the same bytes; the refusals. Lines typed at a terminal, each
translated as it is entered (app/decode/interactive.py). Through the CLI on the tiny run."""

import os
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO, compose_config, run_cli, start_cli, trained_tiny_run

from app.decode.interactive import translate_typed
from app.decode.line_files import open_line_file, read_lines, resume_point, windows
from app.run.errors import UserError

pytestmark = pytest.mark.slow

LINES = [
    "En el principio creó Dios los cielos y la tierra.",
    "Y dijo Dios: Sea la luz.",
    "Y fue la tarde y la mañana el día primero.",
    "Y llamó Dios a la luz Día.",
    "Y vio Dios que era bueno.",
    "Y creó Dios al hombre a su imagen.",
    "Estas son las generaciones de los cielos y de la tierra.",
]
BASE = ("command=translate", "name=tiny", "device=cpu", "decode.beam_size=3")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, corpus_tsv):
    root = trained_tiny_run(tmp_path_factory, corpus_tsv, "files")
    (root / "in.txt").write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    return root


def translate(workdir, *settings, stdin=None):
    result = run_cli(workdir, *BASE, *settings, stdin=stdin)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize(
    "settings",
    [(), ("decode.n_best=3",), ("translate.alignments=true",), ("decode.beam_size=1", "decode.sampling=true")],
    ids=["beam", "n-best", "alignments", "sampling"],
)
def test_windows_write_what_one_window_writes(workdir, settings):
    """Three lines a window, written as each is done, in input order: the output of the whole file in one window
    (beam, n-best with the input's line numbers, word links). Sampling draws window k with seed + k: a resumed run
    draws what the uninterrupted one drew."""
    whole = translate(workdir, *settings, "translate.input=in.txt", "translate.window=1000")
    windowed = translate(workdir, *settings, "translate.input=in.txt", "translate.window=3")
    if "decode.sampling=true" in settings:  # a batch's draws depend on its sentences: the same windows, the same draws
        assert len(windowed.stdout.splitlines()) == len(whole.stdout.splitlines()) == len(LINES)
        (workdir / "drawn.txt").write_text("".join(windowed.stdout.splitlines(True)[:4]), encoding="utf-8")
        with open(workdir / "drawn.txt", "a", encoding="utf-8") as cut:
            cut.write("half a line")
        translate(
            workdir,
            *settings,
            "translate.input=in.txt",
            "translate.window=3",
            "translate.output=drawn.txt",
            "translate.resume=true",
        )
        assert (workdir / "drawn.txt").read_text(encoding="utf-8") == windowed.stdout  # window 2 drawn again, the same
        return
    if settings == ("decode.n_best=3",):  # scores within rounding: batches of other lengths sum in another order
        rows, whole_rows = ([line.split(" ||| ") for line in r.stdout.splitlines()] for r in (windowed, whole))
        assert [r[:2] for r in rows] == [r[:2] for r in whole_rows] and len(rows) == 3 * len(LINES)
        assert [float(r[2]) for r in rows] == pytest.approx([float(r[2]) for r in whole_rows], abs=2e-4)
        assert [r[0] for r in rows[::3]] == [str(i) for i in range(len(LINES))]
    else:
        assert windowed.stdout == whole.stdout and whole.stdout.count("\n") == len(LINES)
    assert windowed.stderr.startswith(f"translating {len(LINES)} lines with ")
    assert (
        f"translated {len(LINES)} lines in " in windowed.stderr and " lines/s) into standard output" in windowed.stderr
    )


@pytest.mark.fresh_interpreter
@pytest.mark.parametrize("nbest", [1, 3])
def test_an_output_cut_anywhere_is_resumed_to_the_same_bytes(workdir, nbest):
    """The whole output, cut at a line's end, in the middle of lines and at its end, then resumed with
    translate.resume=true (windows of 2 lines): the same file each time."""
    settings = (f"decode.n_best={nbest}", "translate.input=in.txt", "translate.window=2")
    whole = translate(workdir, *settings, "translate.output=whole.txt")
    assert whole.stdout == ""
    full = (workdir / "whole.txt").read_bytes()
    line_ends = [i + 1 for i, byte in enumerate(full) if byte == ord("\n")]
    cuts = sorted({line_ends[2] - 5, line_ends[3], line_ends[-2] + 3, len(full)})  # mid-line, a line's end, ...
    for cut in cuts:
        (workdir / "cut.txt").write_bytes(full[:cut])
        resumed = translate(workdir, *settings, "translate.output=cut.txt", "translate.resume=true")
        assert (workdir / "cut.txt").read_bytes() == full, cut
        if nbest == 1 and cut == len(full):
            assert "holds every line's translation already" in resumed.stderr
    (workdir / "fresh.txt").unlink(missing_ok=True)
    fresh = translate(workdir, *settings, "translate.output=fresh.txt", "translate.resume=true")  # no file yet
    assert "resuming fresh.txt at line 1 (window 1)" in fresh.stderr and (workdir / "fresh.txt").read_bytes() == full


def test_resume_point_keeps_whole_windows():
    """Known answers: the window of the first missing line is translated again; an n-best list's last index may be
    incomplete."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "out.txt")
        with open(path, "wb") as f:
            f.write(b"a\nbb\nc\nd")  # 3 complete lines, the 4th cut
        assert resume_point(path, 10, 2, nbest=False) == (2, 5)  # window 2 starts at line 2, after "a\nbb\n"
        assert resume_point(path, 10, 4, nbest=False) == (0, 0)
        assert resume_point(path, 3, 2, nbest=False) == (3, 7)  # every line done
        with pytest.raises(UserError, match="holds translations of 3 lines and the input has 2"):
            resume_point(path, 2, 2, nbest=False)
        with open(path, "wb") as f:
            f.write(b"0 ||| a ||| -1\n0 ||| b ||| -2\n1 ||| c ||| -1\n2 ||| d ||| -1\n")
        assert resume_point(path, 5, 1, nbest=True) == (2, 45)  # line 2 may lack hypotheses: again
        assert resume_point(path, 5, 2, nbest=True) == (2, 45)
        assert resume_point(path, 5, 3, nbest=True) == (0, 0)
        with open(path, "wb") as f:
            f.write(b"a translation\n")
        with pytest.raises(UserError, match="not an n-best line"):
            resume_point(path, 5, 2, nbest=True)


def test_a_killed_translation_resumed_equals_an_uninterrupted_one(workdir):
    """SIGKILL once the output holds some windows, then translate.resume=true: the same bytes as a run never
    stopped."""
    lines = [LINES[i % len(LINES)] + f" {i}" for i in range(1500)]
    (workdir / "big.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    settings = ("decode.beam_size=1", "translate.input=big.txt", "translate.window=100")
    translate(workdir, *settings, "translate.output=big_whole.txt")
    output = workdir / "big_killed.txt"
    process = start_cli(workdir, *BASE, *settings, "translate.output=big_killed.txt", output=workdir / "killed.log")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if output.exists() and output.read_bytes().count(b"\n") >= 300:
            break
        time.sleep(0.02)
    assert process.poll() is None, "finished before it could be killed"
    process.kill()
    process.wait(60)
    kept = output.read_bytes().count(b"\n")
    assert 300 <= kept < len(lines)
    resumed = translate(workdir, *settings, "translate.output=big_killed.txt", "translate.resume=true")
    assert f"at line {kept // 100 * 100 + 1} " in resumed.stderr
    assert output.read_bytes() == (workdir / "big_whole.txt").read_bytes()


@pytest.mark.parametrize(
    "settings,message",
    [
        (("translate.resume=true",), "error: translate.resume=true continues the file translate.output names"),
        (("translate.window=0",), "error: translate.window=0: lines translated at a time, at least 1"),
        (
            ("translate.input=in.txt", "translate.output=long.txt", "translate.resume=true"),
            "error: translate.output='long.txt' holds translations of 9 lines and the input has 7",
        ),
    ],
)
def test_refusals(workdir, settings, message):
    (workdir / "long.txt").write_text("x\n" * 9, encoding="utf-8")
    result = run_cli(workdir, *BASE, *settings, stdin="Hola\n")
    assert result.returncode == 2 and result.stderr.strip().startswith(message), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("setting", ["input", "prefix"])
def test_an_output_that_is_a_file_it_reads_is_refused_and_left_as_it_was(workdir, setting):
    """The output was opened (emptied) before the input was read: no line translated, "translated 7 lines", rc 0."""
    before = (workdir / "in.txt").read_bytes()
    (workdir / "read.txt").write_bytes(before)  # a prefix per line: the lines to translate will do
    reads = ["translate.input=in.txt"] + ([f"translate.{setting}=read.txt"] if setting != "input" else [])
    read = "read.txt" if setting != "input" else "in.txt"
    result = run_cli(workdir, *BASE, *reads, f"translate.output=./{read}")
    message = f"error: translate.output='./{read}' is the file translate.{setting} names: it would be emptied"
    assert result.returncode == 2 and result.stderr.strip().startswith(message), result.stderr
    assert (workdir / read).read_bytes() == before


@pytest.mark.parametrize(
    "settings,where",
    [
        (("translate.input=over.txt",), "translate.input='over.txt': line 6"),
        ((), "standard input: line 6"),
        (("translate.input=in.txt", "translate.prefix=over.txt"), "translate.prefix='over.txt': line 6"),
    ],
    ids=["input", "stdin", "prefix"],
)
def test_a_line_too_long_for_the_model_is_named_by_its_line_before_anything_is_translated(workdir, settings, where):
    """Its number in the file, not in its window of translate.window lines; nothing is written."""
    over = LINES[:5] + [" ".join(["principio"] * 1100)] + LINES[5:]
    (workdir / "over.txt").write_text("".join(line + "\n" for line in over[: len(LINES)]), encoding="utf-8")
    output = workdir / "over_out.txt"
    result = run_cli(
        workdir, *BASE, *settings, "translate.window=2", f"translate.output={output}", stdin="\n".join(over) + "\n"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    limit = r"this model takes at most 1023 \(model\.max_len=1024\): split it"
    message = rf"error: {re.escape(where)} has \d{{4}} subword tokens; {limit}"
    assert re.fullmatch(message, result.stderr.strip()), result.stderr  # the one line, nothing translated
    assert not output.exists()


class Terminal:
    """``python -m app ARGS`` in ``cwd`` with a pseudo-terminal as its standard input and output, as a user's shell
    starts it: ``type`` a line, ``wait_for`` what the terminal shows."""

    def __init__(self, cwd, *args) -> None:
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: never returns
            os.chdir(cwd)
            os.environ.update(PYTHONPATH=REPO, HYDRA_FULL_ERROR="0")
            os.execv(sys.executable, [sys.executable, "-m", "app", *args])
        self.shown = b""

    def wait_for(self, text: str, seconds: float = 120) -> int:
        """Where ``text`` shows, once it has (waiting at most ``seconds``)."""
        import select

        wanted, deadline = text.encode("utf-8"), time.monotonic() + seconds
        while wanted not in self.shown and time.monotonic() < deadline:
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    self.shown += os.read(self.fd, 4096)
                except OSError:  # the child ended and its terminal closed
                    break
        assert wanted in self.shown, f"{text!r} did not show: {self.shown.decode('utf-8', 'replace')[-2000:]}"
        return self.shown.index(wanted)

    def type(self, line: bytes) -> None:
        os.write(self.fd, line)

    def end(self) -> int:
        """Ctrl-D, then the exit code."""
        self.type(b"\x04")
        self.wait_for("typed lines")
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def test_lines_typed_at_a_terminal_are_translated_as_each_is_entered(workdir):
    """The model loads first and says so; each line is translated once it is entered, as the same line given in a
    pipe is; a line that cannot be translated is refused in one line and the session goes on; Ctrl-D ends it."""
    expected = translate(workdir, stdin=f"{LINES[0]}\n{LINES[1]}\n").stdout.splitlines()
    terminal = Terminal(workdir, *BASE)
    ready = terminal.wait_for("type a line and press Enter: its translation is written here; Ctrl-D ends")
    loaded = terminal.wait_for("translating the lines typed here with ")
    assert loaded < terminal.wait_for("checkpoints/tiny/best.pt (step 40): beam 3, length penalty 1.0") < ready
    terminal.type(f"{LINES[0]}\n".encode())
    first = terminal.wait_for(f"{expected[0]}\r\n")  # before the next line is typed
    terminal.type(b"\xff\xfe Hola\n")
    terminal.wait_for("error: line 2: not valid UTF-8\r\n")
    terminal.type(("principio " * 200 + "\n").encode())  # 1,400 pieces; the model takes 1,023
    terminal.wait_for("error: line 3 has 1400 subword tokens; this model takes at most 1023")
    terminal.type(f"{LINES[1]}\n".encode())
    second = terminal.wait_for(f"{expected[1]}\r\n")
    assert terminal.end() == 0
    assert terminal.wait_for("translated 2 of 4 typed lines in") > second > first > ready
    assert b"Traceback" not in terminal.shown


@pytest.mark.parametrize("setting", ["translate.prefix=p.txt", "translate.constraints=c.txt", "translate.resume=true"])
def test_typed_lines_refuse_what_pairs_a_file_line_by_line_with_them(setting):
    cfg = compose_config("name=tiny", "translate.output=out.txt", setting, command="translate")
    refusal = r"give the lines to translate in a file \(translate\.input=\.\.\.\) or a pipe, not typed at a terminal"
    with pytest.raises(UserError, match=refusal):
        translate_typed(cfg)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_a_byte_order_mark_is_not_read_as_text(tmp_path, window):
    """A BOM before the first line (a file saved by some editors) was read as part of its first word: translated,
    scored, or a baseline's first hypothesis. From a later window on, nothing is cut."""
    (tmp_path / "bom.txt").write_bytes("".join(line + "\n" for line in LINES[:3]).encode("utf-8-sig"))
    marked = open_line_file(str(tmp_path / "bom.txt"), "translate.input", "translate", str(tmp_path))
    assert [line for lines in windows(marked, window) for line in lines] == LINES[:3]
    assert next(windows(marked, window, start=1))[0] == LINES[1]
    assert read_lines(str(tmp_path / "bom.txt"), "eval.baseline", "compare against") == LINES[:3]


@pytest.mark.parametrize("environment,expected", [({}, "128 128"), ({"LRU_CACHE_CAPACITY": "7"}, "7 128")])
def test_the_command_bounds_onednns_caches_before_torch_loads(environment, expected):
    """Every command (python -m app) bounds oneDNN's per-shape kernel caches, which a long CPU decoding filled by
    ~0.5 GB at their defaults; a value the environment gives wins."""
    script = (
        "import os, runpy, sys\n"
        "sys.argv = ['app', 'command=translate', 'translate.window=0']\n"
        "try:\n    runpy.run_module('app', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print(os.environ['LRU_CACHE_CAPACITY'], os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env={**env, **environment}, capture_output=True, text=True
    )
    assert result.stdout.strip().splitlines()[-1] == expected, result.stderr[-2000:]
