"""The tests' warm interpreter (tests/warm_cli.py) runs ``python -m app`` as a fresh interpreter does."""

import conftest
from conftest import run_cli


def test_a_forked_run_answers_as_a_fresh_interpreter(tmp_path):
    for args in (["--help"], ["command=train", "train.max_stepz=3"], ["command=translate", "name=nothing_here"]):
        answered = conftest.forked_runs
        warm = run_cli(tmp_path, *args, stdin="Hola.\n")
        assert conftest.forked_runs == answered + 1  # a fork answered, not a subprocess
        fresh = run_cli(tmp_path, *args, stdin="Hola.\n", fresh=True)
        assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args
    assert warm.returncode == 2 and "nothing_here/best.pt: checkpoint not found" in warm.stderr


def test_a_changed_environment_gets_a_warm_interpreter_made_in_it(tmp_path, monkeypatch):
    run_cli(tmp_path, "--help")
    before = conftest._warm
    monkeypatch.setenv("NMT_TEST_SETTING", "1")
    answered = conftest.forked_runs
    result = run_cli(tmp_path, "--help")
    assert result.returncode == 0 and conftest.forked_runs == answered + 1
    assert conftest._warm is not before and conftest._warm.env["NMT_TEST_SETTING"] == "1"
    assert not before.alive()  # the old one was closed


def test_the_fork_runs_in_the_requested_folder_with_the_requested_input(tmp_path):
    """Also a second test's runs fork a warm interpreter: pytest's name of the running test, which changes the
    environment at each test, leaves it warm."""
    (tmp_path / "a.es").write_text("uno\n", encoding="utf-8")
    answered = conftest.forked_runs
    result = run_cli(tmp_path, "command=translate", "name=missing", "translate.input=a.es")
    assert conftest.forked_runs == answered + 1
    fresh = run_cli(tmp_path, "command=translate", "name=missing", "translate.input=a.es", fresh=True)
    assert conftest.forked_runs == answered + 1
    assert result.returncode == fresh.returncode != 0
    assert result.stderr == fresh.stderr and str(tmp_path) in result.stderr
