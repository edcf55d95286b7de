"""Loading a trained run for evaluation and translation."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from app.checkpoint import load_checkpoint
from app.data.corpus import load_split
from app.config import Config, DecodeConfig
from app.data.corpus import load_tokenizer
from app.data.tokenizer import Tokenizer
from app.decoding import Hypotheses, decode_corpus
from app.errors import UserError
from app.evaluation import bleu_by_length, score
from app.models import build_model
from app.training import amp_dtype, vocab_fingerprint
from app.utils import atomic_write_text, resolve_device


@dataclass
class TrainedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: DictConfig  # the configuration the model was trained with
    device: torch.device
    dtype: torch.dtype | None

    def translate(self, src: list[list[int]], decode: DecodeConfig, progress: bool = False) -> Hypotheses:
        if decode.beam_size < 1 or decode.n_best > decode.beam_size:
            raise UserError(f"decode.beam_size={decode.beam_size} must be >= 1 and >= decode.n_best={decode.n_best}")
        return decode_corpus(self.model, src, self.device, decode.batch_tokens, decode.max_len_ratio,
                             decode.max_len_extra, amp_dtype=self.dtype, progress=progress,
                             beam_size=decode.beam_size, alpha=decode.length_penalty, n_best=decode.n_best)


def load_trained(run_dir: str, which: str, device: torch.device) -> TrainedModel:
    if which not in ("best", "last"):
        raise UserError(f"checkpoint={which!r}: choose best or last")
    path = os.path.join(run_dir, f"{which}.pt")
    state = load_checkpoint(path, device)
    trained = OmegaConf.merge(OmegaConf.structured(Config), state["config"])
    tokenizer = load_tokenizer(trained.data.dir, trained.tokenizer)
    if vocab_fingerprint(tokenizer) != state["vocab"]:
        raise UserError(f"{path}: the tokenizer {tokenizer.src_path} is not the one this model was trained with")
    model = build_model(trained.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
    model.load_state_dict(state["model"])
    model.to(device).eval()
    return TrainedModel(model, tokenizer, trained, device, amp_dtype(trained.train.amp, device))


def evaluate_run(cfg: Config) -> dict:
    """Decode a split with a run's checkpoint, score it, write ``eval/<split>/{hyp.txt,metrics.json}``."""
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
    print(f"{cfg.eval.split} ({metrics['decoding']}): BLEU {metrics['bleu']:.2f}  chrF {metrics['chrf']:.2f}  "
          f"TER {metrics['ter']:.2f}  ({len(texts)} sentences, {metrics['sentences_per_s']} sent/s on {metrics['device']})")
    print(f"  {metrics['bleu_signature']}\n  {metrics['chrf_signature']}\n  {metrics['ter_signature']}")
    print(f"  wrote {out_dir}/hyp.txt and metrics.json")
    return metrics
