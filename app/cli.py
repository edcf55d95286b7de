"""Command line: ``python -m app {prepare,train,eval,translate} [hydra overrides]``."""
from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from app.config import register_configs
from app.errors import UserError
from app.interrupt import TrainingInterrupted

log = logging.getLogger("app")
COMMANDS = ("prepare", "train", "eval", "translate", "bench", "compare", "average")
register_configs()


def prepare_command(cfg: DictConfig) -> None:
    from app.data.corpus import prepare_data

    prepare_data(cfg)


def train_command(cfg: DictConfig) -> None:
    from app import distributed
    from app.inference import evaluate_run
    from app.training import train

    train(cfg)
    if cfg.train.evaluate and distributed.is_main():  # under torchrun: once, on rank 0
        evaluate_run(cfg)


def eval_command(cfg: DictConfig) -> None:
    from app.inference import evaluate_run

    evaluate_run(cfg)


def translate_command(cfg: DictConfig) -> None:
    from app.inference import load_trained
    from app.utils import resolve_device

    lines = read_translate_input(cfg.translate.input)  # bad input fails before the model loads
    trained = load_trained(cfg.run_dir, cfg.translate.checkpoint, resolve_device(cfg.device))
    src = trained.tokenizer.encode_src(lines)
    hyps = trained.translate(src, cfg.decode)
    if cfg.decode.n_best > 1:  # Moses n-best format: input index ||| hypothesis ||| score
        text = "".join(
            f"{i} ||| {trained.tokenizer.decode_tgt([tokens])[0]} ||| {score:.4f}\n"
            for i, hypotheses in enumerate(hyps.nbest) for tokens, score in hypotheses
        )
    else:
        text = "".join(t + "\n" for t in trained.tokenizer.decode_tgt(hyps.tokens))
    if cfg.translate.output:
        with open(cfg.translate.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


def read_translate_input(path: str | None) -> list[str]:
    """Lines to translate from a file or stdin; an empty input or undecodable bytes is an error."""
    where = path or "standard input"
    if path and not os.path.isfile(path):
        raise UserError(f"translate.input={path!r}: file not found")
    source = open(path, "rb") if path else sys.stdin.buffer
    lines = []
    with source:
        for line_no, raw in enumerate(source, start=1):
            try:
                lines.append(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError:
                raise UserError(f"{where}:{line_no}: not valid UTF-8") from None
    if not lines:
        raise UserError(f"{where}: nothing to translate (no input lines)")
    return lines


def average_command(cfg: DictConfig) -> None:
    from app.checkpoint import average_snapshots, save_checkpoint

    state, paths = average_snapshots(cfg.run_dir, cfg.average.last)
    out = os.path.join(cfg.run_dir, "averaged.pt")
    save_checkpoint(out, state)
    print(f"averaged {len(paths)} snapshots ({', '.join(state['averaged'])}) into {out}; "
          f'evaluate it with: make eval ARGS="name={cfg.name} eval.checkpoint=averaged"')


def bench_command(cfg: DictConfig) -> None:
    from app.bench import bench

    bench(cfg)


def compare_command(cfg: DictConfig) -> None:
    from app.compare import compare_report

    if not cfg.compare.dir:
        raise UserError("compare.dir is not set: give the sweep folder of a `train -m` run")
    compare_report(cfg.compare.dir, cfg.eval.split)


HANDLERS = {
    "prepare": prepare_command, "train": train_command, "eval": eval_command,
    "translate": translate_command, "bench": bench_command, "compare": compare_command,
    "average": average_command,
}


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _hydra_entry(cfg: DictConfig) -> None:
    command = os.environ["NMT_COMMAND"]
    try:
        HANDLERS[command](cfg)
    except TrainingInterrupted as err:
        if int(os.environ.get("RANK", 0)) == 0:  # every rank stopped at the same step: say it once
            print(f"interrupted: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m app {{{','.join(COMMANDS)}}} [key=value ...]", file=sys.stderr)
        sys.exit(2)
    command = argv.pop(0)
    os.environ["NMT_COMMAND"] = command
    # Each command keeps its own copy of Hydra's record, so eval does not overwrite train's.
    extra = [f"hydra.job.name={command}", f"hydra.output_subdir=.hydra/{command}"]
    if command in ("prepare", "bench", "compare"):
        run_dir = "checkpoints" if command == "compare" else "${data.dir}"
        extra = [f"hydra.job.name={command}", "hydra.output_subdir=null", f"hydra.run.dir={run_dir}"]
    if int(os.environ.get("RANK", 0)) > 0:  # torchrun workers other than rank 0 write no files, not even Hydra's
        extra = [e for e in extra if not e.startswith("hydra.output_subdir=")]
        extra += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    sys.argv = [sys.argv[0], *argv, *extra]
    _hydra_entry()
