from omegaconf import DictConfig, OmegaConf
from torch import nn

from app.config import ModelConfig
from app.errors import UserError


def build_model(cfg: ModelConfig, src_vocab: int, tgt_vocab: int, joint_vocab: bool) -> nn.Module:
    from app.models.rnn import RNNSeq2Seq
    from app.models.transformer import Transformer

    if isinstance(cfg, DictConfig):
        # a plain dataclass: models read settings in forward, where an OmegaConf lookup is slow and
        # stops torch.compile's tracing (a graph break)
        cfg = ModelConfig(**OmegaConf.to_container(cfg, resolve=True))
    families = {"transformer": Transformer, "rnn": RNNSeq2Seq}
    if cfg.arch not in families:
        raise UserError(f"model.arch={cfg.arch!r} is unknown; available: {sorted(families)}")
    try:
        return families[cfg.arch](cfg, src_vocab, tgt_vocab, joint_vocab)
    except ValueError as err:
        raise UserError(str(err)) from None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
