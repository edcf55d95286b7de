"""train.compile=true: the torch.compile'd Transformer trains like the eager one, and batches of new
shapes reuse the compiled graphs instead of compiling again."""
import pytest
import torch
from omegaconf import OmegaConf

from app.config import Config, ModelConfig
from app.data.batching import Batch
from app.errors import UserError
from app.models import build_model
from app.training import compiled_for_training, make_optimizer, train_step

SHAPES = [(3, 6, 6), (4, 7, 3), (2, 9, 11), (5, 4, 4), (3, 12, 8)]  # (sentences, source, target length); source = target in the first


def config(compile: bool, **model):
    cfg = OmegaConf.structured(Config)
    cfg.model = OmegaConf.structured(ModelConfig(dropout=0.0, attention_dropout=0.0, **model))
    cfg.train.compile = compile
    return cfg


def batches():
    gen = torch.Generator().manual_seed(0)
    for n, s, t in SHAPES:
        src, tgt = torch.randint(4, 30, (n, s), generator=gen), torch.randint(4, 30, (n, t + 1), generator=gen)
        src[0, -2:] = 0  # padding: the key mask is part of the graph
        yield Batch(src, torch.arange(n), tgt[:, :-1], tgt[:, 1:])


def train(compile: bool):
    cfg = config(compile, arch="transformer", d_model=16, heads=2, enc_layers=1, dec_layers=1, ff_dim=32)
    torch.manual_seed(0)
    model = build_model(cfg.model, 30, 30, True)
    optimizer, scheduler = make_optimizer(model, cfg)
    trained = compiled_for_training(model, cfg)
    losses, graphs = [], []
    for batch in batches():
        loss, _, _ = train_step(trained, [batch], int(batch.tgt_out.numel()), optimizer, scheduler, cfg, None)
        losses.append(loss.item())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return model, losses, graphs


def test_compiled_training_matches_eager_and_compiles_once_for_all_shapes():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, eager_losses, _ = train(compile=False)
    compiled, compiled_losses, graphs = train(compile=True)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    assert graphs[0] > 0  # it did compile
    assert graphs[-1] == graphs[0]  # four more shapes, no new graph


def test_compile_refuses_rnns_with_a_clear_message():
    cfg = config(True, arch="rnn", attention="bahdanau", emb_dim=8, hidden=8)
    model = build_model(cfg.model, 30, 30, True)
    with pytest.raises(UserError, match="train.compile=true compiles Transformers"):
        compiled_for_training(model, cfg)
    assert compiled_for_training(model, config(False, arch="rnn", attention="bahdanau", emb_dim=8, hidden=8)) is model
