"""train.compile=true: the Transformer's compiled layers (and the RNN decoders' compiled loop step) train
like the eager ones, every layer of a stack reuses one graph, and batches of new shapes reuse the compiled
graphs instead of compiling again, in fp32 and under bf16 autocast on bf16 weights."""

import dataclasses

import pytest
import torch
from conftest import Vocab, model_config

from app.config.schema import Config
from app.data.batching import Batch
from app.models import build_model
from app.run.errors import UserError
from app.train.master_weights import MasterWeights
from app.train.summary import CompileWatch
from app.train.update import compiled_for_training, make_optimizer, train_step

pytestmark = pytest.mark.slow  # every test here runs the real CLI in a subprocess, or compiles

SHAPES = [
    (3, 6, 6),
    (4, 7, 3),
    (2, 9, 11),
    (5, 4, 4),
    (3, 12, 8),
]  # (sentences, source, target length); source = target in the first
# Inductor picks a CPU reduction strategy by the size of sentences × source length (a guard at 32): RNN
# shapes stay on one side of it, as real batches do
RNN_SHAPES = [(5, 8, 8), (6, 9, 4), (4, 12, 11), (7, 6, 6), (5, 14, 9)]


TRANSFORMER = dict(
    arch="transformer",
    d_model=16,
    heads=2,
    enc_layers=2,
    dec_layers=2,
    ff_dim=32,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


def config(compile: bool, **model):
    cfg = Config(model=model_config(dropout=0.0, **model))
    cfg.train.compile = compile
    return cfg


def batches(shapes):
    gen = torch.Generator().manual_seed(0)
    for n, s, t in shapes:
        src, tgt = torch.randint(4, 30, (n, s), generator=gen), torch.randint(4, 30, (n, t + 1), generator=gen)
        src[0, -2:] = 0  # padding: the key mask is part of the graph
        yield Batch(src, torch.arange(n), tgt[:, :-1], tgt[:, 1:], (src != 0).sum(-1))


def train(compile: bool, dtype=None, **model):
    cfg = config(compile, **(model or TRANSFORMER))
    torch.manual_seed(0)
    model = build_model(cfg.model, Vocab(30, 30))
    optimizer, scheduler = make_optimizer(model, cfg)
    master = MasterWeights(model, dtype)  # bf16: the step runs on bf16 copies of the weights
    trained = compiled_for_training(master.compute, cfg)
    losses, graphs, watch = [], [], CompileWatch(compile)
    for step, batch in enumerate(batches(SHAPES if cfg.model.arch == "transformer" else RNN_SHAPES), start=1):
        with watch.watch(step):  # what the Trainer logs at the end of a run
            n_tokens = int(batch.tgt_out.numel())
            result = train_step(trained, [batch], n_tokens, optimizer, scheduler, cfg, dtype, master=master)
        losses.append(result.loss_sum.item())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    if compile:
        assert watch.graphs == graphs[-1] and watch.steps == [1], watch.describe()
        assert watch.describe().startswith(f"built {graphs[-1]} graph(s) in ")
    return model, losses, graphs


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_layers_match_eager_and_compile_once_for_all_layers_and_shapes(dtype):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, eager_losses, _ = train(compile=False, dtype=dtype)
    compiled, compiled_losses, graphs = train(compile=True, dtype=dtype)
    tolerance = 1e-4 if dtype is None else 2e-2  # bf16: the compiled kernels round at other places
    assert compiled_losses == pytest.approx(eager_losses, rel=tolerance)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a, b, atol=1e-5 if dtype is None else 1e-3)
    # one graph for both encoder layers, one for both decoder layers, and none for four more shapes
    assert graphs[0] == graphs[-1] == 2


def test_compiled_layers_run_eagerly_in_evaluation():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, _, graphs = train(compile=True)
    model.eval()
    src, tgt = next(batches([(2, 5, 4)])).src, torch.randint(4, 30, (2, 4))
    with torch.no_grad():
        model(src, tgt)
        model.decode(model.encode(src), tgt, need_attention=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs[-1]  # no graph for eval or weights


RNN = dict(arch="rnn", emb_dim=8, hidden=8, enc_layers=1, dec_layers=2)


@pytest.mark.parametrize(
    "decoder",
    [
        dict(attention="bahdanau"),
        dict(attention="luong", score="general", cell="lstm"),
        dict(attention="luong", score="dot"),
        dict(attention="luong", score="general", local_window=2),  # local-m: the position a tensor, not a constant
        dict(attention="luong", score="dot", local_window=2, local_alignment="predictive"),
        dict(attention="bahdanau", coverage=True),  # the coverage: one more tensor of the state
        dict(attention="luong", score="concat", input_feeding=False, coverage=True),  # no feed: None each step
    ],
)
def test_compiled_rnn_loop_step_matches_eager_and_compiles_once_for_all_shapes(decoder):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, eager_losses, _ = train(compile=False, **RNN, **decoder)
    compiled, compiled_losses, graphs = train(compile=True, **RNN, **decoder)
    assert type(compiled.decoder.loop_step).__name__ != "method"  # the compiled wrapper took its place
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    assert graphs[0] == graphs[-1] == 1  # dynamic from the first call: no graph for any later shape


def test_compile_leaves_an_rnn_decoder_without_a_loop_eager(caplog):
    cfg = config(True, **RNN, attention="luong", input_feeding=False)
    model = build_model(cfg.model, Vocab(30, 30))
    assert compiled_for_training(model, cfg) is model
    assert "no loop to compile" in caplog.text
    assert type(model.decoder.loop_step).__name__ == "method"


def test_an_unknown_compile_mode_gets_a_one_line_error():
    cfg = config(True, **TRANSFORMER)
    with pytest.raises(UserError, match="train.compile_mode='fast' is not a choice: choose default, reduce-overhead"):
        dataclasses.replace(cfg.train, compile_mode="fast")  # the schema refuses it before anything compiles
