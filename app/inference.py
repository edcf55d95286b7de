"""Loading a trained run for evaluation and translation."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from app.checkpoint import load_checkpoint
from app.config import Config, DecodeConfig
from app.data.corpus import load_tokenizer
from app.data.tokenizer import Tokenizer
from app.decoding import Hypotheses, decode_corpus
from app.errors import UserError
from app.models import build_model
from app.training import amp_dtype, vocab_fingerprint


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
