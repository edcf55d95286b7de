from torch import nn

from app.config import ModelConfig
from app.errors import UserError


def build_model(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, joint_vocab: bool) -> nn.Module:
    if cfg.arch == "transformer":
        from app.models.transformer import Transformer

        try:
            return Transformer(cfg, src_vocab, tgt_vocab, joint_vocab)
        except ValueError as err:
            raise UserError(str(err)) from None
    raise UserError(f"model.arch={cfg.arch!r} is unknown; available: transformer")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
