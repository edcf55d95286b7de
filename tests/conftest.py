import os
import sys

# test helpers (toy_tasks.py) import as top-level modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The data tests read local files and local dataset folders only: never reach the Hugging Face hub.
# Set before anything imports `datasets`, which reads these once at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import atexit  # noqa: E402
import subprocess  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402

SWORD = "/usr/share/sword"
# Genesis 1-3: a few minutes of real parallel text (80 verses), read in well under a second.
GENESIS_VERSES = {1: 31, 2: 25, 3: 24}


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module: a tiny model runs faster on one thread than on two contended ones."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def genesis_pairs():
    """[(ref, spanish, english)] for Genesis 1-3 from the installed SWORD modules."""
    from app.data.osis import bible_verses

    refs = [f"Gen.{c}.{v}" for c, n in GENESIS_VERSES.items() for v in range(1, n + 1)]
    es = bible_verses(SWORD, "spaRV1909eb", refs)
    en = bible_verses(SWORD, "engWEB2015eb", refs)
    return [(ref, es[ref], en[ref]) for ref in refs]


@pytest.fixture
def write_tsv(tmp_path):
    """write_tsv(name, rows) -> path of a TSV file in tmp_path with one tab-joined row per line."""

    def write(name, rows):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")
        return str(path)

    return write


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Genesis 1-6 (160 verses): the corpus of the CLI runs
CORPUS_CHAPTERS = {1: 31, 2: 25, 3: 24, 4: 26, 5: 32, 6: 22}
# A 1+1-layer Transformer on it: a CLI training run takes seconds on 2 CPU cores
TINY = [
    "data=files",
    "data.name=tiny",
    "data.train=corpus.tsv",
    "data.dev_fraction=0.08",
    "data.test_fraction=0.08",
    "tokenizer.vocab_size=400",
    "model=transformer_small",
    "model.d_model=32",
    "model.heads=2",
    "model.enc_layers=1",
    "model.dec_layers=1",
    "model.ff_dim=64",
    "train.batch_tokens=2000",
    "train.warmup_steps=10",
    "train.eval_every=20",
    "train.save_every=20",
    "train.log_every=10",
    "device=cpu",
    "name=tiny",
    "viz.sentences=2",
    "viz.eval_plots=2",
]


_warm = None  # tests/warm_cli.py WarmInterpreter, made at the first run
# a fresh_interpreter test's warm interpreters, each with a string hash seed of its own: its runs take them in turn
_seeded: list = []
SEEDED = 3  # a run, the one it resumes and the one they are compared with: three seeds
_seeded_turn = 0  # the running fresh_interpreter test's runs so far
_fresh_test = False  # the running test is marked fresh_interpreter
forked_runs = 0  # the runs a warm interpreter answered


@pytest.fixture(autouse=True)
def _fresh_interpreters(request):
    """A test marked fresh_interpreter compares processes (a resume, a seed): each of its runs gets another string
    hash seed than the run before it, and than the one before that, as separate interpreters of a user's would
    (set and dictionary orders of strings are the hash seed's): forks of SEEDED warm interpreters, each started
    with a seed of its own, taken in turn."""
    global _fresh_test, _seeded_turn
    _fresh_test = request.node.get_closest_marker("fresh_interpreter") is not None
    _seeded_turn = 0
    yield
    _fresh_test = False


def _close_warm() -> None:
    for warm in [_warm, *_seeded]:
        if warm is not None:
            warm.close()


atexit.register(_close_warm)


def _warm_interpreter(full_env: dict, fresh: bool):
    """The test process's warm interpreter for this environment (in a fresh_interpreter test, the next of the seeded
    ones), or None where a fresh interpreter is asked for."""
    global _warm, _seeded_turn
    if fresh or os.environ.get("NMT_TESTS_FRESH") == "1":
        return None
    from warm_cli import WarmInterpreter

    if _fresh_test:
        turn, _seeded_turn = _seeded_turn % SEEDED, _seeded_turn + 1
        if turn < len(_seeded) and not _seeded[turn].serves(full_env):  # the environment changed: all made anew
            for warm in _seeded:
                warm.close()
            _seeded.clear()
        while len(_seeded) <= turn:  # seeds 1, 2, 3: any fixed seeds differ from one another
            _seeded.append(WarmInterpreter(full_env, REPO, hash_seed=len(_seeded) + 1))
        return _seeded[turn]
    if _warm is not None and not _warm.serves(full_env):
        _warm.close()
        _warm = None
    _warm = _warm or WarmInterpreter(full_env, REPO)
    return _warm


def start_cli(cwd, *args, output):
    """``python -m app ARGS`` started in ``cwd`` as a shell starts it (its own process group, SIGINT handled),
    its stdout and stderr written into the file ``output``; returns the process (``pid``, ``poll``, ``wait``,
    ``returncode``). A fork of the warm interpreter where run_cli would use one and it is free, else a fresh
    interpreter. The caller waits for it, or kills its process group and then waits."""
    global forked_runs
    full_env = {**os.environ, "PYTHONPATH": REPO, "HYDRA_FULL_ERROR": "0"}
    open(output, "wb").close()  # there, empty, from the start
    warm = _warm_interpreter(full_env, fresh=False)
    if warm is not None and warm.lock.acquire(blocking=False):
        try:
            process = warm.start(cwd, args, full_env, str(output), str(output), on_end=warm.lock.release)
        except BaseException:
            warm.lock.release()
            raise
        forked_runs += 1
        return process
    with open(output, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "app", *args],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=as_a_terminal_starts_it,
        )


def as_a_terminal_starts_it() -> None:
    """In the child, before Python starts: SIGINT handled by default, as in a process a terminal's shell starts. A
    test runner's worker (pytest-xdist's) may ignore SIGINT, and a child inherits an ignored signal."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(cwd, *args, stdin=None, timeout=600, env=None, fresh=False):
    """``python -m app ARGS`` in ``cwd``, as a user runs it; returns the CompletedProcess.

    A fork of this test process's warm interpreter runs it (tests/warm_cli.py: the same command without its
    seconds of imports; in a fresh_interpreter test, the next of the seeded ones) unless ``fresh`` or ``env`` asks
    for an interpreter of its own, or NMT_TESTS_FRESH=1 asks it of every run. A test that changed the environment
    gets a new warm interpreter, made in it."""
    global forked_runs
    full_env = {**os.environ, "PYTHONPATH": REPO, "HYDRA_FULL_ERROR": "0", **(env or {})}
    warm = _warm_interpreter(full_env, fresh=fresh or bool(env))
    if warm is not None and warm.lock.acquire(blocking=False):
        try:
            result = warm.run(cwd, args, stdin, timeout, full_env)
            forked_runs += 1
            return result
        finally:
            warm.lock.release()
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def trained_tiny_run(tmp_path_factory, corpus_tsv, name: str):
    """A fresh folder holding the tiny corpus and a 40-step ``tiny`` run trained through the CLI."""
    import shutil

    root = tmp_path_factory.mktemp(name)
    shutil.copy(corpus_tsv, root / "corpus.tsv")
    result = run_cli(root, "command=train", *TINY, "train.max_steps=40")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture(scope="session")
def corpus_tsv(tmp_path_factory):
    """A TSV (ref, spanish, english) of Genesis 1-6 from the installed SWORD modules."""
    from app.data.osis import bible_verses

    refs = [f"Gen.{c}.{v}" for c, n in CORPUS_CHAPTERS.items() for v in range(1, n + 1)]
    es = bible_verses(SWORD, "spaRV1909eb", refs)
    en = bible_verses(SWORD, "engWEB2015eb", refs)
    path = tmp_path_factory.mktemp("corpus") / "corpus.tsv"
    path.write_text("".join(f"{ref}\t{es[ref]}\t{en[ref]}\n" for ref in refs), encoding="utf-8")
    return path


@pytest.fixture
def corpus_folder(tmp_path, corpus_tsv, monkeypatch):
    """A test's own folder holding the tiny corpus (``corpus.tsv``), the working directory while it runs: where its
    in-process runs (training.train) prepare data/ and write their run folders."""
    import shutil

    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def compose_config(*overrides, command="train"):
    """The project's configuration with these overrides, as the CLI builds it: the schema's dataclasses.
    Hydra's output folder is not made: run_dir is checkpoints/<name> unless an override sets it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import app.cli  # noqa: F401  (registers the schema and the resolvers of conf/config.yaml)
    from app.config.load import load_config

    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"command={command}", *overrides])
    if OmegaConf.is_interpolation(cfg, "run_dir"):
        cfg.run_dir = None
    return load_config(cfg)


class Vocab(NamedTuple):
    """Vocabulary sizes for a model built without a tokenizer (what build_model reads of one)."""

    src_vocab_size: int
    tgt_vocab_size: int
    joint: bool = True


def model_config(**settings):
    """The model schema of ``settings["arch"]`` (Transformer by default) with these settings."""
    from app.config.schema import MODEL_SCHEMAS

    return MODEL_SCHEMAS[settings.get("arch", "transformer")](**settings)


# Text whose words hold characters SentencePiece's default normalization (nmt_nfkc) makes a space: a ZWNJ inside a
# Persian word ("mi‌xahm", one word to str.split()), "´" (a space and a combining accent)
NFKC_PAIRS = [
    ("mi\u200cxahm ketab ra bexanam", "i want to read the book", {(0, 0), (0, 1), (3, 2), (3, 3), (1, 4), (1, 5)}),
    ("don\u00b4t go there", "do not go there", {(0, 0), (0, 1), (1, 2), (2, 3)}),
]


@pytest.fixture(scope="session")
def nfkc_tokenizer(tmp_path_factory):
    """A joint SentencePiece model (the project's special ids, the default normalization) of a tiny corpus."""
    import sentencepiece as spm

    from app.data.tokenizer import Tokenizer

    corpus = ["mi xahm ketab ra bexanam", "i want to read the book", "don´t go there", "do not go there"] * 50
    prefix = str(tmp_path_factory.mktemp("nfkc") / "m")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_prefix=prefix,
        vocab_size=60,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return Tokenizer(f"{prefix}.model", f"{prefix}.model")


def surface_words(surfaces: list[str], text: str) -> list[int]:
    """The whitespace word of ``text`` each piece's characters fall in, from the pieces' surfaces (which spell the
    text, one after the other); a piece of no letter (a space, a ▁ the normalization made) is of the word the next
    piece begins, where it begins one, else of none (-1): written apart from the tokenizer's byte spans, to check
    them."""
    import re

    words = [m.span() for m in re.finditer(r"\S+", text)]
    out, at = [], 0
    for surface in surfaces:
        begin, at = at, at + len(surface)
        out.append(next((w for w, (a, b) in enumerate(words) if max(a, begin) < min(b, at)), -1))
    assert at == len(text), (surfaces, text)
    for k in range(len(surfaces) - 2, -1, -1):
        if not surfaces[k].strip() and surfaces[k + 1][:1].strip():
            out[k] = out[k + 1]
    return out
