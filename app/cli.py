"""Command line: ``python -m app command=<command> [key=value ...]``, every argument a Hydra override.

The command is a setting like any other: the dispatch table below is the one list of commands, and
Hydra's own record of a run (``.hydra/<command>/``) says which command ran with which settings.
"""

from __future__ import annotations

import difflib
import gc
import hashlib
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from app.config.load import config_error, load_config, parsed_override, register_configs
from app.config.schema import Config
from app.run.errors import DiskFull, TrainingInterrupted, UserError, causes, disk_full
from app.run.folder_lock import LOCK_FILE, FolderLock
from app.run.record import FolderBefore

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
# commands that belong to no run keep their log here and write no record of settings
NO_RUN_DIRS = {"prepare": "data", "bench": "checkpoints/bench", "compare": "checkpoints/compare"}
# commands that write a run's files own its folder while they run (translate only reads it)
# what each command owns in a run folder: training all of it (its checkpoints, snapshots, log, tb/); make eval,
# average and export only their own outputs, so they run beside a training run, one of each kind at a time
OWNING_COMMANDS = {
    "train": LOCK_FILE,
    "eval": f"{LOCK_FILE}-eval",
    "average": f"{LOCK_FILE}-average",
    "export": f"{LOCK_FILE}-export",
    "align": f"{LOCK_FILE}-align",
    "heads": f"{LOCK_FILE}-heads",
}


def prepare_command(cfg: Config) -> None:
    """make data: the corpus cleaned, split and tokenized (SentencePiece, Arrow cache)."""
    from app.data.corpus import prepare_data
    from app.train.init_from import StartingPoint

    if cfg.train.init_from:  # the corpus tokenized as the fine-tuning run will read it
        StartingPoint(cfg.train.init_from).adopt_tokenizer(cfg)
    prepare_data(cfg, verify=True)  # make data repairs whatever is damaged


def train_command(cfg: Config) -> None:
    """make train: trains a model (resumes, budgets, validation with BLEU and attention)."""
    from app.evaluation.eval_run import evaluated
    from app.run import distributed
    from app.run.checkpoint import intact_checkpoints, intact_note
    from app.train.state import finished
    from app.train.stop_rules import resume_hint
    from app.train.trainer import train

    keep = cfg.train.auto_resume and finished(cfg.run_dir)
    if keep:
        print(f"{cfg.run_dir}: finished earlier (train_summary.json), kept as it is (train.auto_resume=true)")
    else:
        try:
            train(cfg)
        except DiskFull as err:
            intact = intact_checkpoints(cfg.run_dir)
            then = f"continue with: {resume_hint()}" if intact else "train again"
            raise DiskFull(f"{err}; {intact_note(cfg.run_dir, intact)}: once there is space, {then}") from None
    if cfg.train.evaluate and distributed.is_main() and not (keep and evaluated(cfg)):  # under torchrun: on rank 0
        eval_command(cfg)


def eval_command(cfg: Config) -> None:
    """make eval: translates a split, scores it (BLEU, chrF, TER, AER) and draws its attention."""
    from app.evaluation.eval_run import evaluate_run
    from app.report.evaluation_files import write_evaluation

    write_evaluation(evaluate_run(cfg))


def translate_command(cfg: Config) -> None:
    """make translate: translates lines from a file or stdin; lines typed at a terminal one at a time, as entered."""
    if cfg.translate.input is None and sys.stdin.isatty():
        from app.decode.interactive import translate_typed

        translate_typed(cfg)
        return
    from app.decode.translate import translate_lines

    translate_lines(cfg)


def score_command(cfg: Config) -> None:
    """make score: how probable each given translation is under the model."""
    from app.decode.likelihood import score_pairs

    score_pairs(cfg)


def serve_command(cfg: Config) -> None:
    """make serve: a page and an API that translate and show the attention live."""
    from app.serve.server import serve

    serve(cfg)


def align_command(cfg: Config) -> None:
    """make align: word links (Pharaoh) for every pair of a parallel corpus."""
    from app.evaluation.corpus_links import align_corpus

    align_corpus(cfg)


def heads_command(cfg: Config) -> None:
    """make heads: how much each attention head of a Transformer matters (masked one by one, and pruned)."""
    from app.evaluation.head_importance import measure_heads
    from app.report.head_report import write_heads

    write_heads(measure_heads(cfg))


def export_command(cfg: Config) -> None:
    """make export: the run as a CTranslate2 model."""
    from app.decode.export import export_run

    export_run(cfg)


def average_command(cfg: Config) -> None:
    """make average: the newest snapshots averaged into one checkpoint."""
    from app.run.checkpoint import average_snapshots, save_checkpoint

    state, paths = average_snapshots(cfg.run_dir, cfg.average.last)
    out = os.path.join(cfg.run_dir, "averaged.pt")
    save_checkpoint(out, state)
    print(
        f"averaged {len(paths)} snapshots ({', '.join(state['averaged'])}) into {out}; "
        f'evaluate it with: make eval ARGS="name={cfg.name} eval.checkpoint=averaged"'
    )


def bench_command(cfg: Config) -> None:
    """make bench: training and decoding speed, MFU and memory."""
    if cfg.bench.serve:  # make serve's API under concurrent clients, instead of the training and decoding rows
        from app.bench.serving import bench_serve

        bench_serve(cfg)
        return
    from app.bench.suite import bench

    if bench(cfg)["failed_rows"]:  # every other row was still measured, printed and written
        sys.exit(1)


def compare_command(cfg: Config) -> None:
    """make compare: one report over the runs of a sweep."""
    from app.report.compare import compare_report

    if not cfg.compare.dir:
        raise UserError("compare.dir is not set: give the sweep folder of a `--multirun command=train` run")
    compare_report(cfg.compare.dir, cfg.eval.split, cfg.compare.out, cfg.compare.baseline)


COMMANDS: dict[str, Callable[[Config], None]] = {
    "prepare": prepare_command,
    "train": train_command,
    "eval": eval_command,
    "translate": translate_command,
    "score": score_command,
    "serve": serve_command,
    "export": export_command,
    "align": align_command,
    "heads": heads_command,
    "bench": bench_command,
    "compare": compare_command,
    "average": average_command,
}
ENSEMBLE_COMMANDS = ("eval", "translate", "score", "serve")  # the commands that decode with ensemble=
USAGE = f"python -m app command={{{','.join(COMMANDS)}}} [key=value ...]"


def command_list() -> str:
    """Every command with the first line of its function's docstring: what ``--help`` lists."""
    width = max(map(len, COMMANDS))
    return "\n".join(f"  {name:<{width}}  {(run.__doc__ or '').strip()}" for name, run in COMMANDS.items())


def checked(cfg: DictConfig) -> Config:
    """The schema's objects for a composed configuration with a known command (else a UserError)."""
    if OmegaConf.is_missing(cfg, "command") or cfg.command is None:  # not given, or command=null
        raise UserError(f"command is not set: {USAGE}; python -m app --help says what each does")
    config = load_config(cfg)
    if config.command not in COMMANDS:
        close = difflib.get_close_matches(str(config.command), list(COMMANDS), n=1)
        guess = f"did you mean command={close[0]}? " if close else ""
        raise UserError(f"command={config.command!r} is unknown: {guess}{USAGE}")
    if config.ensemble and config.command not in ENSEMBLE_COMMANDS:
        raise UserError(f"ensemble= decodes with {', '.join(ENSEMBLE_COMMANDS)}: not with command={config.command}")
    return config


def job_dir(overrides: str) -> str:
    """A sweep run's folder from its settings (Hydra's override_dirname): readable, and a short hash where
    the settings hold a path or are too long for a folder name."""
    if not overrides:
        return "defaults"
    name = overrides.replace("/", "_")
    if name != overrides or len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha1(overrides.encode()).hexdigest()[:8]}"
    return name


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def run_folder(command: str, name: str, task_overrides: list[str]) -> str:
    """Hydra's output folder (the log, the settings record): the run folder, ``run_dir=`` where given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if command in NO_RUN_DIRS:
        return NO_RUN_DIRS[command]
    overrides = OverridesParser.create().parse_overrides(list(task_overrides))
    given = [o.value() for o in overrides if o.key_or_group == "run_dir"]
    return str(given[-1]) if given else f"checkpoints/{name}"


# the run folder as it was before Hydra wrote into it (a single run on rank 0): undone after a refusal
_before: FolderBefore | None = None


class OwnRunFolder(Callback):
    """The run folder (a sweep's folder under --multirun) is locked before Hydra writes its log and settings
    record there: a second training process on it stops at once, naming the first (app/run/folder_lock.py), as does
    a second make eval, average or export beside one already running (each writes its own outputs only, so
    they run beside training). Under torchrun rank 0 takes the lock for every rank of its launcher; the other
    ranks write nothing there."""

    def __init__(self) -> None:
        self.lock: FolderLock | None = None

    def take(self, config: DictConfig, folder_key: str) -> None:
        if OmegaConf.select(config, "command", default=None) not in OWNING_COMMANDS or _rank() > 0:
            return
        folder, command = OmegaConf.select(config, folder_key), OmegaConf.select(config, "command")
        self.lock = FolderLock(folder, OWNING_COMMANDS[command])
        try:  # Hydra turns an exception of a callback into a warning and goes on: exit here
            self.lock.acquire(advice=": wait for it to end, or give another name= (or run_dir=)")
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        except OSError as err:
            print(f"error: {folder}: cannot lock it ({err.strerror})", file=sys.stderr)
            sys.exit(2)

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        global _before
        command = OmegaConf.select(config, "command", default=None)
        if isinstance(command, str) and _rank() == 0:
            _before = FolderBefore(OmegaConf.select(config, "hydra.run.dir"), command)
        self.take(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.take(config, "hydra.sweep.dir")

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        if self.lock:
            self.lock.release()

    on_multirun_end = on_run_end


# Hydra's own settings per command (conf/config.yaml): where it logs, and whether it keeps a record
OmegaConf.register_new_resolver("app_run_dir", run_folder)
OmegaConf.register_new_resolver(
    "app_record_dir", lambda command: None if command in NO_RUN_DIRS or _rank() > 0 else f".hydra/{command}"
)
OmegaConf.register_new_resolver("app_job_dir", job_dir)
OmegaConf.register_new_resolver("app_commands", lambda: command_list())
OmegaConf.register_new_resolver(
    "app_log_file", lambda folder, job: os.devnull if _rank() > 0 else os.path.join(folder, f"{job}.log")
)
register_configs()


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def run(dict_cfg: DictConfig) -> None:
    try:
        cfg = checked(dict_cfg)
        if not gc.isenabled():  # paused by app/__main__.py: what the imports made stays out of every collection
            import torch  # noqa: F401  (every command imports it: ~170,000 objects, imported while paused)

            gc.freeze()
            gc.enable()
        COMMANDS[str(cfg.command)](cfg)  # a known command (checked)
    except TrainingInterrupted as err:
        if _rank() == 0:  # every rank stopped at the same step: say it once
            print(f"interrupted: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        if _before is not None:  # refused before it started: no folder, no record, no log left for it
            _before.undo()
        sys.exit(2)
    except KeyboardInterrupt:
        exit_interrupted()
    except Exception as err:
        if not disk_full(err):
            raise
        where = next((f" of {name}" for e in causes(err) if (name := getattr(e, "filename", None))), "")
        print(f"error: no space left on the device{where}: free some and run again", file=sys.stderr)
        sys.exit(2)


def check_arguments(args: list[str], multirun: bool = True) -> None:
    """Compose the configuration before Hydra runs the command, so that a mistyped key, a wrong type,
    an unknown preset or a missing setting is one line naming it (Hydra would print several, some with
    a traceback) and no run folder is made for it. Each value of a sweep is checked, the other sweeps
    at their first value; without ``multirun`` (--multirun, -m) a sweep is refused, naming the quoted form of one
    value that holds a comma."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        parser = OverridesParser.create()
        parsed = [parsed_override(parser, line) for line in args]
        for override, line in zip(parsed, args):
            if override.is_sweep_override() and not multirun:
                key, value = line.split("=", 1)
                raise UserError(
                    f"{line} is a sweep, which runs with --multirun; one value holding a comma is quoted: "
                    f"\"{key}='{value}'\""
                )
        values = [
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [line]
            for o, line in zip(parsed, args)  # one override per argument
        ]
        first = [options[0] for options in values]
        variants = [first] + [first[:i] + [v] + first[i + 1 :] for i, options in enumerate(values) for v in options[1:]]
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            for overrides in variants:
                cfg = compose("config", overrides=overrides)
                cfg.run_dir = None  # Hydra's output folder: set when it runs the command
                checked(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(config_error(err)) from None


def exit_interrupted() -> NoReturn:
    """Ctrl-C: one line, exit status 130, the exit handlers run (lock files, logs).

    CPython also marks a KeyboardInterrupt raised inside ``exec`` of a string (a dataclass's or namedtuple's
    methods being made as a module imports) as uncaught, even where the program catches it, and then ends the
    process by SIGINT after its exit handlers instead of with the status asked for (Python/pythonrun.c,
    run_eval_code_obj). Each exec of a string clears that mark first: an empty one after the catch does."""
    print("interrupted", file=sys.stderr)
    exec("")
    sys.exit(130)


def typed_arguments(text: str) -> list[str]:
    """``make``'s ARGS as typed (the Makefile hands them over in NMT_ARGS): split at the spaces outside quotes, the
    quotes kept. Hydra reads a value holding a comma, a bracket or ``<``/``>`` only in quotes, which the shell
    would strip from a command line."""
    words: list[str] = []
    word, quote = "", ""
    for char in text:
        if char.isspace() and not quote:
            words, word = words + [word] * bool(word), ""
            continue
        if quote and char == quote:
            quote = ""
        elif not quote and char in "'\"":
            quote = char
        word += char
    if quote:
        raise UserError(f"ARGS={text}: its {quote} quote is not closed")
    return words + [word] * bool(word)


def main() -> None:
    try:
        sys.argv[1:] = args = sys.argv[1:] + typed_arguments(os.environ.pop("NMT_ARGS", ""))
        if args and args[0] in COMMANDS:
            raise UserError(f"the command is a setting: python -m app command={args[0]} {' '.join(args[1:])}".rstrip())
        flags = {a for a in args if a.startswith("-")}
        if flags <= {"-m", "--multirun"}:  # other flags (--help, --cfg, ...) are Hydra's own
            check_arguments([a for a in args if not a.startswith("-")], multirun=bool(flags))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # while the settings are composed and checked, before the command runs
        exit_interrupted()
    run()
