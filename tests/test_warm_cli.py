"""The tests' warm interpreter (tests/warm_cli.py) runs ``python -m app`` as a fresh interpreter does."""

import subprocess

import conftest
import pytest
from conftest import run_cli, start_cli


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


def test_a_started_fork_is_waited_for_and_a_second_start_beside_it_is_fresh(tmp_path):
    """start_cli returns at once; the fork's output and error arrive in one file, its exit code by wait. A
    second start while the first runs gets a fresh interpreter: one fork at a time. (tests/test_stopping.py
    signals started forks' process groups in every phase of a run.)"""
    answered = conftest.forked_runs
    refused = start_cli(tmp_path, "command=eval", "name=nothing_here", output=tmp_path / "refused.log")
    assert conftest.forked_runs == answered + 1
    assert refused.wait(120) == 2 and refused.poll() == 2 and refused.returncode == 2
    assert "nothing_here/best.pt: checkpoint not found" in (tmp_path / "refused.log").read_text()

    first = start_cli(tmp_path, "command=eval", "name=nothing_here", output=tmp_path / "first.log")
    beside = start_cli(tmp_path, "--help", output=tmp_path / "beside.log")
    assert isinstance(beside, subprocess.Popen) and conftest.forked_runs == answered + 2
    assert beside.wait(120) == 0 and "command=" in (tmp_path / "beside.log").read_text()
    assert first.wait(120) == 2
    assert run_cli(tmp_path, "--help").returncode == 0 and conftest.forked_runs == answered + 3  # free again


@pytest.mark.fresh_interpreter
def test_the_runs_of_a_test_that_compares_processes_fork_interpreters_of_other_hash_seeds(tmp_path):
    """Each run of a fresh_interpreter test has another string hash seed than the two runs before it, as separate
    interpreters have, without paying their imports: a fork of the next of three warm interpreters, each started
    with a seed of its own."""
    answered = conftest.forked_runs
    before = {id(warm): warm.forks for warm in conftest._seeded}
    for _ in range(4):
        assert run_cli(tmp_path, "--help").returncode == 0
    assert conftest.forked_runs == answered + 4  # forks answered each run
    assert [warm.forks - before.get(id(warm), 0) for warm in conftest._seeded] == [2, 1, 1]  # in turn
    seeds = []
    for warm in conftest._seeded:  # the seed each interpreter started with, which its forks share
        with open(f"/proc/{warm.process.pid}/environ", "rb") as environ:
            seeds += [v for v in environ.read().split(b"\0") if v.startswith(b"PYTHONHASHSEED=")]
    assert seeds == [b"PYTHONHASHSEED=1", b"PYTHONHASHSEED=2", b"PYTHONHASHSEED=3"]
    assert all("PYTHONHASHSEED" not in warm.env for warm in conftest._seeded)  # not passed on to the runs
