"""Fine-tuning: a run that starts from another run's weights (``train.init_from``) instead of random ones, as
fairseq's ``--finetune-from-model`` and JoeyNMT's ``load_model`` with its resets do.

What it takes from the run it starts from: the weights users get (``model`` of the checkpoint: the moving
average where there is one) and the tokenizer (its SentencePiece model tokenizes this run's corpus:
``tokenizer.dir``). What starts afresh: AdamW's moments, the learning-rate warm-up and schedule, the step
count, the best dev BLEU and early stopping, the batch order. The model settings must be the same, but for
the dropouts and the guided-alignment layer, which a fine-tuning run often changes, and the coverage mechanism, which
a fine-tuning run may add (See et al. 2017 add it to a trained model): its weight starts at 0, so the model starts
computing what it did."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import torch

from app.config.load import check_model_settings, check_vocabulary, config_from_dict
from app.config.schema import Config
from app.run.checkpoint import UnloadableCheckpoint, checkpoint_step, load_checkpoint, named_checkpoint
from app.run.errors import UserError

log = logging.getLogger(__name__)

# model settings a fine-tuning run may change: they shape no weight
FREE_SETTINGS = ("dropout", "attention_dropout", "activation_dropout", "align_layer")
# model settings a fine-tuning run may turn on, with the names of the weights each adds: they start at 0, where the
# model computes what it did without them (model.coverage: w_c, app/models/attention.py)
ADDABLE_SETTINGS = {"coverage": "w_c"}


def start_checkpoint(init_from: str) -> str:
    """The checkpoint ``train.init_from`` names: a ``.pt`` file, a run folder's best.pt, or that of the run of
    that name (``checkpoints/<name>/best.pt``)."""
    path = named_checkpoint(init_from)
    if not os.path.isfile(path):
        given = f"train.init_from={init_from}: {path} does not exist"
        raise UserError(f"{given} (give a run name, a run folder or a .pt file)")
    return path


class StartingPoint:
    """The checkpoint a fine-tuning run starts from, read once (memory-mapped: the weights are read when loaded)."""

    def __init__(self, init_from: str):
        self.path = start_checkpoint(init_from)
        try:
            self.state = load_checkpoint(self.path, mmap=True)
        except UnloadableCheckpoint as err:
            raise UserError(f"train.init_from={init_from}: {err}") from None
        self.config = config_from_dict(self.state["config"])
        self.step = checkpoint_step(self.state)
        self.added: list[str] = []  # the ADDABLE_SETTINGS this run turns on

    def tokenizer_dir(self) -> str:
        """Where its SentencePiece model is: its corpus folder, or the folder it took its own from."""
        return self.config.tokenizer.dir or self.config.data.dir

    def adopt_tokenizer(self, cfg: Config) -> None:
        """Tokenize ``cfg``'s corpus with this run's tokenizer: its settings, its folder (``tokenizer.dir``)."""
        cfg.tokenizer = dataclasses.replace(self.config.tokenizer, dir=self.tokenizer_dir())

    def load_weights(self, model: torch.nn.Module, vocab: dict, cfg: Config) -> dict:
        """Its weights into ``model`` (of ``cfg.model``'s settings, on the tokenizer of fingerprint ``vocab``: its
        own, unless its files changed since); returns what the run records of its start (train_summary.json
        ``init_from``)."""
        check_vocabulary(self.state, self.path, vocab)  # its model settings were checked by ``starting_point``
        missing, unexpected = model.load_state_dict(self.state["model"], strict=False)
        added = tuple(ADDABLE_SETTINGS[setting] for setting in self.added)
        if unexpected or [key for key in missing if not (added and key.endswith(added))]:
            raise RuntimeError(f"{self.path}: weights missing {missing}, unexpected {unexpected}")
        for setting in self.added:
            log.info("fine-tuning turns model.%s on: its new weights start at 0, the model as trained", setting)
        log.info(
            "fine-tuning from %s (step %d): its weights and its tokenizer in %s; optimizer, learning-rate schedule "
            "and step start afresh",
            self.path,
            self.step,
            self.tokenizer_dir(),
        )
        return {"checkpoint": self.path, "step": self.step}


def starting_point(cfg: Config, resume: bool = False) -> Optional[StartingPoint]:
    """The run ``train.init_from`` names, its tokenizer adopted by ``cfg`` (a resumed run too: it goes on
    tokenizing as it began); None without the setting. A new run's model settings are checked here, before
    any data work: a mismatch is told at once, not after a corpus is prepared."""
    if not cfg.train.init_from:
        return None
    start = StartingPoint(cfg.train.init_from)
    start.adopt_tokenizer(cfg)
    theirs = start.config.model
    start.added = [k for k in ADDABLE_SETTINGS if getattr(cfg.model, k, False) and not getattr(theirs, k, False)]
    if not resume:
        check_model_settings(start.state, start.path, cfg.model, free=FREE_SETTINGS + tuple(start.added))
    return start
