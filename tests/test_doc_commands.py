"""Every command line that README.md and docs/ show (``make <target> ARGS="..."``, ``python -m app ...``) is
composed as the command would compose it, configuration only: an example that no longer composes fails here."""

import glob
import os
import re
import shlex

import pytest
from conftest import REPO

from app.cli import check_arguments, typed_arguments
from app.run.errors import UserError

# make targets and the command each runs (Makefile); compare composes its training sweep
MAKE_COMMANDS = {
    "data": "prepare",
    "train": "train",
    "eval": "eval",
    "translate": "translate",
    "score": "score",
    "serve": "serve",
    "export": "export",
    "align": "align",
    "average": "average",
    "bench": "bench",
    "compare": "train",
}
COMPARE_DEFAULTS = {"COMPARE_MODELS": "rnn_plain,rnn_bahdanau,rnn_luong,transformer", "COMPARE_EXPERIMENT": "compare"}
COMMAND = re.compile(
    r"make(?: -s)? (?P<target>[a-z-]+)(?P<vars>(?: [A-Z_]+=\S+)*) ARGS=(?P<args>\"[^\"]*\"|'[^']*'|[^\s`]+)"
    r"|(?:\.venv/bin/)?python -m app (?P<app>[^`\n|]*)"
)


def documented_commands() -> list:
    """(where, overrides) for each command line of the docs, placeholders (<run>, ..., $VAR) given a value."""
    found = []
    for path in ["README.md", *sorted(glob.glob("docs/**/*.md", root_dir=REPO, recursive=True))]:
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            text = f.read().replace("\\\n", " ")  # a shell line continued on the next one
        for match in COMMAND.finditer(text):
            where = f"{path}:{text.count(chr(10), 0, match.start()) + 1}"
            if match.group("app") is not None:
                if "[key=value" in match.group("app"):  # the usage line, not an example
                    continue
                if set(re.findall(r"(?<!\S)-\S*", match.group("app"))) - {"-m", "--multirun"}:
                    continue  # Hydra's own flags (--help, --cfg): the CLI leaves them to Hydra, as here
                found.append(pytest.param(placeholders(match.group("app")), id=where))
                continue
            if match.group("target") not in MAKE_COMMANDS:
                continue
            made = dict(COMPARE_DEFAULTS, **dict(v.split("=", 1) for v in match.group("vars").split()))
            overrides = [f"command={MAKE_COMMANDS[match.group('target')]}"]
            if match.group("target") == "compare":
                overrides += [f"model={made['COMPARE_MODELS']}", f"experiment={made['COMPARE_EXPERIMENT']}"]
            args = placeholders(
                match.group("args")[1:-1] if match.group("args")[0] in "\"'" else match.group("args"), make=True
            )
            found.append(pytest.param(overrides + args, id=where))
    return found


def placeholders(line: str, make: bool = False) -> list[str]:
    """The overrides of a documented line, with its placeholders filled or left out; make's ARGS reach the app as
    typed, quotes and all (app/cli.py: typed_arguments), a shell line without its quotes."""
    line = re.sub(r"<[^>]*overrides[^>]*>", "", line)
    line = re.sub(r"<[a-z_ ]+>", "1", line).replace("…", "...")  # a name, a run folder, a seed; more
    words = typed_arguments(line) if make else shlex.split(line, comments=True)
    return [word for word in words if word != "..." and not word.startswith("$")]


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 50  # the pattern still finds the docs' command lines


@pytest.mark.parametrize("overrides", COMMANDS)
def test_a_documented_command_composes(overrides):
    try:
        check_arguments(overrides)
    except UserError as err:
        pytest.fail(f"{' '.join(overrides)}: {err}")
