"""A trained run, loaded to translate with: its model, tokenizer and settings from a checkpoint, or its
CTranslate2 export (``make export``) behind the same ``translate`` and ``score`` calls."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from tqdm import tqdm

from app.config.commands import DecodeConfig
from app.config.load import config_from_dict
from app.config.schema import Config
from app.data.corpus import load_tokenizer
from app.data.tokenizer import Tokenizer
from app.decode.ct2_engine import EXPORT_INFO, CT2Translator, export_command, export_dir
from app.decode.ensemble import Ensemble
from app.decode.mbr import Search, minimum_bayes_risk
from app.decode.passes import decode_corpus, forced_attention, forced_pass
from app.decode.search import Hypotheses
from app.models import Family, build_model, has_attention
from app.run.checkpoint import (
    SNAPSHOT,
    UnloadableCheckpoint,
    checkpoint_path,
    checkpoint_step,
    intact_checkpoints,
    intact_note,
    load_checkpoint,
    missing_checkpoint,
    named_checkpoint,
)
from app.run.device import amp_dtype, resolve_device
from app.run.errors import UserError


@dataclass
class TrainedModel:
    model: Family | Ensemble  # behind the model API (app/models/api.py)
    tokenizer: Tokenizer
    config: Config  # the configuration the model was trained with
    device: torch.device
    dtype: torch.dtype | None
    step: int = 0  # the training step of the checkpoint (of the newest averaged snapshot)
    members: list[str] = field(default_factory=list)  # an ensemble's checkpoints, "best.pt (step 721)" (else empty)

    @property
    def max_positions(self) -> Optional[int]:
        """The positions the model has, an input's EOS included (None: any length), as CT2Translator's."""
        return getattr(self.model, "max_positions", None)

    def translate(
        self,
        src: list[list[int]],
        decode: DecodeConfig,
        progress: bool = False,
        need_attention: bool = False,
        prefix: Optional[list[list[int]]] = None,
        constraints: Optional[list[list[list[int]]]] = None,
    ) -> Hypotheses:
        """Hypotheses of ``src`` under ``decode``; each begins with its ``prefix`` pieces where given and contains
        each of its ``constraints`` (target phrases' pieces). With ``decode.mbr_candidates``, the candidates' choice
        by minimum Bayes risk (app/decode/mbr.py), its attention read while forcing it through the decoder."""
        self.check_decoding(decode)
        if not decode.mbr_candidates:
            return decode_corpus(
                self.model, src, self.device, decode, self.dtype, need_attention, progress, prefix, constraints
            )
        search: Search = lambda s, d, p, c: decode_corpus(  # noqa: E731
            self.model, s, self.device, d, self.dtype, False, progress, p, c
        )
        hyps = minimum_bayes_risk(search, src, decode, self.tokenizer.decode_tgt, prefix, constraints, progress)
        if need_attention:
            start = time.perf_counter()
            maps = dict(forced_attention(self.model, src, hyps.tokens, self.device, decode.batch_tokens, self.dtype))
            hyps.attention = [maps[i] for i in range(len(src))] if maps else None
            assert hyps.mbr is not None  # minimum_bayes_risk's figures
            hyps.mbr["attention_seconds"] = round(time.perf_counter() - start, 2)
        return hyps

    def nbest_attention(self, src: list[list[int]], hyps: Hypotheses, batch_tokens: int) -> list[list[torch.Tensor]]:
        """Per sentence, the attention (..., target + EOS, source + EOS) of each of its hypotheses of ``hyps``,
        best first: the best's from the search, the others' read while forcing each through the decoder (the same
        model on the same tokens: the same weights up to rounding); [] for a model without attention."""
        if hyps.attention is None:
            return []
        nbest = [[tokens for tokens, _ in n] for n in hyps.nbest] if hyps.nbest else [[t] for t in hyps.tokens]
        maps: list[list] = [[hyps.attention[i]] + [None] * (len(n) - 1) for i, n in enumerate(nbest)]
        others = [(i, k) for i, n in enumerate(nbest) for k in range(1, len(n))]
        if others:
            sources, targets = [src[i] for i, _ in others], [nbest[i][k] for i, k in others]
            for j, weights in forced_attention(self.model, sources, targets, self.device, batch_tokens, self.dtype):
                i, k = others[j]
                maps[i][k] = weights
        return maps

    def check_decoding(self, decode: DecodeConfig) -> None:
        """A decoding setting this model cannot follow is a UserError: a coverage penalty without attention."""
        if decode.coverage_penalty and decode.beam_size > 1 and not has_attention(self.config.model):
            raise UserError(
                f"decode.coverage_penalty={decode.coverage_penalty} reads the attention: this model "
                "(model.attention=none) has none; set it to 0"
            )

    def score(
        self, src: list[list[int]], tgt: list[list[int]], batch_tokens: int, progress: bool = False, attention=False
    ) -> tuple[list, Optional[list]]:
        """Per pair, log p of each target token and the EOS after them and, with ``attention``, the cross-attention
        that read them (None for a model without): one teacher-forced pass (app.decode.passes.forced_pass)."""
        scores: list = [None] * len(src)
        maps: list = [None] * len(src)
        bar = tqdm(total=len(src), desc="scoring", unit="pair", disable=not progress, leave=False)
        passes = forced_pass(self.model, src, tgt, self.device, batch_tokens, self.dtype, True, attention)
        for i, logp, weights in passes:
            assert logp is not None  # asked for
            scores[i], maps[i] = logp.tolist(), weights
            bar.update()
        bar.close()
        return scores, maps if attention and src and maps[0] is not None else None


def load_trained(
    run_dir: str, which: str, device: torch.device, setting: str = "eval.checkpoint", ensemble: Sequence[str] = ()
) -> TrainedModel:
    """The checkpoint ``which`` (best, last, averaged, step_NNNNNNN: the value of ``setting``) of ``run_dir``
    on ``device``, in eval mode. One that does not load names those that do. With ``ensemble`` (the setting
    ``ensemble=``), those checkpoints decode with it as one model (app/decode/ensemble.py)."""
    path = checkpoint_path(run_dir, which, setting)
    if not os.path.exists(path):
        raise missing_checkpoint(run_dir, path, setting)
    try:
        state = load_checkpoint(path)
    except UnloadableCheckpoint as err:
        intact = intact_note(run_dir, intact_checkpoints(run_dir, skip=path))
        raise UnloadableCheckpoint(f"{err}; {intact}: choose one with {setting}=") from None
    trained = config_from_dict(state["config"])
    tokenizer = load_tokenizer(trained.data.dir, trained.tokenizer)
    if tokenizer.fingerprint() != state["vocab"]:
        raise UserError(f"{path}: the tokenizer {tokenizer.src_path} is not the one this model was trained with")
    model = build_model(trained.model, tokenizer)
    model.load_state_dict(state["model"])
    model.to(device).eval()
    dtype, step = amp_dtype(trained.train.amp, device), checkpoint_step(state)
    if not ensemble:
        return TrainedModel(model, tokenizer, trained, device, dtype, step)
    members, names = [model], [f"{os.path.basename(path)} (step {step})"]
    for other in ensemble:
        member, name = load_member(ensemble_checkpoint(run_dir, other), tokenizer, path, device)
        members.append(member)
        names.append(name)
    return TrainedModel(Ensemble(members), tokenizer, trained, device, dtype, step, names)


def ensemble_checkpoint(run_dir: str, other: str) -> str:
    """The file an ``ensemble=`` entry names: a checkpoint of this run (best, last, averaged, step_NNNNNNN), a
    ``.pt`` file, or a run's best.pt (a run folder, or the name of one under checkpoints/)."""
    this_run = other in ("best", "last", "averaged") or SNAPSHOT.match(f"{other}.pt")
    path = checkpoint_path(run_dir, other) if this_run else named_checkpoint(other)
    if not os.path.isfile(path):
        raise UserError(
            f"ensemble: {other}: {path} does not exist (give a checkpoint of this run, a run, or a .pt file)"
        )
    return path


def load_member(path: str, tokenizer: Tokenizer, first: str, device: torch.device) -> tuple[Family, str]:
    """One more model of an ensemble, and its name; it must share the first one's vocabulary."""
    try:
        state = load_checkpoint(path)
    except UnloadableCheckpoint as err:
        raise UserError(f"ensemble: {err}") from None
    if state["vocab"] != tokenizer.fingerprint():
        raise UserError(
            f"ensemble: {path} was trained with another vocabulary than {first}: they cannot decode together"
        )
    model = build_model(config_from_dict(state["config"]).model, tokenizer)
    model.load_state_dict(state["model"])
    same_run = os.path.dirname(os.path.abspath(path)) == os.path.dirname(os.path.abspath(first))
    name = os.path.basename(path) if same_run else os.path.relpath(path)
    return model.to(device).eval(), f"{name} (step {checkpoint_step(state)})"


def load_ct2(
    cfg: Config, trained: Optional[TrainedModel], setting: str, asked: tuple[str, str] = ("", "")
) -> CT2Translator:
    """The run's CTranslate2 export (``make export``) on ``cfg.device``. It must be an export of the checkpoint
    asked for: with ``trained``, of its step (an export left from an earlier checkpoint would be scored as this
    one); else of the checkpoint ``asked`` names, (setting, value) such as ("translate.checkpoint", "best")."""
    if cfg.ensemble:
        raise UserError(f"{setting}=ct2: an export is one model; an ensemble= decodes with the torch engine")
    path = export_dir(cfg)
    if not os.path.exists(os.path.join(path, EXPORT_INFO)):
        raise UserError(f"{setting}=ct2: no CTranslate2 export in {path}; {export_command(cfg)} writes it")
    device = trained.device if trained else resolve_device(cfg.device)
    engine = CT2Translator(path, device=device.type, device_index=device.index or 0)
    exported = engine.info.get("run", {})
    held = f"{path} holds {exported.get('checkpoint')} (step {exported.get('step')})"
    if trained and exported.get("step") != trained.step:
        raise UserError(
            f"{setting}=ct2: {held}, eval.checkpoint={cfg.eval.checkpoint} is step {trained.step}: make export again "
            f"({export_command(cfg, cfg.eval.checkpoint)})"
        )
    name, value = asked
    if name and exported.get("checkpoint") != value:
        raise UserError(
            f"{setting}=ct2: {held}, not {name}={value}: export that one ({export_command(cfg, value)}) or give "
            f"{name}={exported.get('checkpoint')}"
        )
    return engine
