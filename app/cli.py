"""Command line: ``python -m app {prepare,train,eval,translate} [hydra overrides]``."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import hydra
from omegaconf import DictConfig

from app.config import register_configs
from app.errors import UserError

log = logging.getLogger("app")
COMMANDS = ("prepare", "train", "eval", "translate", "bench")
register_configs()


def prepare_command(cfg: DictConfig) -> None:
    from app.data.corpus import prepare_data

    prepare_data(cfg)


def train_command(cfg: DictConfig) -> None:
    from app.training import train

    train(cfg)


def eval_command(cfg: DictConfig) -> None:
    import torch

    from app.data.corpus import load_split
    from app.evaluation import bleu_by_length, score
    from app.inference import load_trained
    from app.utils import atomic_write_text, resolve_device

    trained = load_trained(cfg.run_dir, cfg.eval.checkpoint, resolve_device(cfg.device))
    data = load_split(trained.config.data.dir, cfg.eval.split, trained.tokenizer)
    start = time.time()
    hyps = trained.translate(data.src, cfg.decode, progress=True)
    seconds = time.time() - start
    texts = trained.tokenizer.decode_tgt(hyps.tokens)
    metrics = score(texts, data.tgt_texts)
    metrics["bleu_by_source_length"] = bleu_by_length(texts, data.tgt_texts, data.src_texts, list(cfg.eval.length_buckets))
    metrics.update(
        split=cfg.eval.split, checkpoint=cfg.eval.checkpoint,
        decoding="greedy" if cfg.decode.beam_size == 1 else f"beam {cfg.decode.beam_size}, length penalty {cfg.decode.length_penalty}",
        decode_seconds=round(seconds, 2), sentences_per_s=round(len(texts) / seconds, 1),
        tokens_per_s=round(sum(len(h) + 1 for h in hyps.tokens) / seconds),
        device=torch.cuda.get_device_name(trained.device) if trained.device.type == "cuda" else "cpu",
    )
    out_dir = os.path.join(cfg.run_dir, "eval", cfg.eval.split)
    atomic_write_text(os.path.join(out_dir, "hyp.txt"), "".join(t + "\n" for t in texts))
    atomic_write_text(os.path.join(out_dir, "metrics.json"), json.dumps(metrics, indent=2))
    print(f"{cfg.eval.split} ({metrics['decoding']}): BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  TER {metrics['ter']:.2f}  "
          f"({len(texts)} sentences, {metrics['sentences_per_s']} sent/s on {metrics['device']})")
    print(f"  {metrics['bleu_signature']}\n  {metrics['chrf_signature']}\n  {metrics['ter_signature']}")
    print(f"  wrote {out_dir}/hyp.txt and metrics.json")


def translate_command(cfg: DictConfig) -> None:
    from app.inference import load_trained
    from app.utils import resolve_device

    trained = load_trained(cfg.run_dir, cfg.translate.checkpoint, resolve_device(cfg.device))
    source = open(cfg.translate.input, encoding="utf-8") if cfg.translate.input else sys.stdin
    with source:
        lines = [line.rstrip("\n") for line in source]
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


def bench_command(cfg: DictConfig) -> None:
    from app.bench import bench

    bench(cfg, steps=cfg.bench.steps, warmup=cfg.bench.warmup)


HANDLERS = {
    "prepare": prepare_command, "train": train_command, "eval": eval_command,
    "translate": translate_command, "bench": bench_command,
}


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _hydra_entry(cfg: DictConfig) -> None:
    command = os.environ["NMT_COMMAND"]
    try:
        HANDLERS[command](cfg)
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
    if command in ("prepare", "bench"):
        extra = [f"hydra.job.name={command}", "hydra.output_subdir=null", "hydra.run.dir=${data.dir}"]
    sys.argv = [sys.argv[0], *argv, *extra]
    _hydra_entry()
