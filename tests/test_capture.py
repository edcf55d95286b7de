"""train.capture (app/train/capture.py): what a CPU can check of the captured update. Recording and replaying
the graphs needs CUDA (tests/test_gpu.py: captured losses equal the eager ones step by step, a shape that cannot be
recorded runs eagerly); here: when capture is in force and why not, the batch shapes it pads to, the learning rate
a replay reads, and the values the metrics window keeps of an update whose outputs the next replay rewrites."""

import pytest
import torch
from conftest import Vocab, compose_config, model_config
from test_batch_shapes import correlated_lengths

from app.config.schema import TrainConfig
from app.data.schedule import training_schedule
from app.data.shapes import CAPTURE_PADDING, CAPTURE_SHAPES, BatchShapes
from app.models import build_model
from app.train.capture import capture_refusal, learning_rate_on_device, learning_rate_on_host
from app.train.metrics_window import MetricsWindow
from app.train.update import StepResult, make_optimizer

CUDA = torch.device("cuda")  # a device object only: capture_refusal reads its type


@pytest.fixture(scope="module")
def transformer():
    return build_model(model_config(d_model=16, heads=2, enc_layers=1, dec_layers=1, ff_dim=32), Vocab(40, 40))


@pytest.fixture(scope="module")
def rnn():
    return build_model(model_config(arch="rnn", emb_dim=8, hidden=16, attention="bahdanau"), Vocab(40, 40))


def test_capture_is_in_force_for_a_single_cuda_transformer_only(transformer, rnn):
    cfg = compose_config()
    assert cfg.train.capture is True  # the default
    assert capture_refusal(cfg, CUDA, False, transformer) is None
    assert capture_refusal(cfg, torch.device("cpu"), False, transformer) == "not on CUDA"  # a CPU run is unchanged
    # the compiled layers' kernels are recorded like the eager ones, unless the compiler replays graphs of its own
    assert capture_refusal(compose_config("train.compile=true"), CUDA, False, transformer) is None
    refusals = {
        "train.capture=false": (compose_config("train.capture=false"), False, transformer),
        "torchrun": (cfg, True, transformer),
        "train.compile_mode=reduce-overhead": (
            compose_config("train.compile=true", "train.compile_mode=reduce-overhead"),
            False,
            transformer,
        ),
        "train.fused_optimizer=false": (compose_config("train.fused_optimizer=false"), False, transformer),
        "train.subword_alpha": (compose_config("train.subword_alpha=0.1"), False, transformer),
        "RNN": (cfg, False, rnn),
    }
    for expected, (settings, launched, model) in refusals.items():
        reason = capture_refusal(settings, CUDA, launched, model)
        assert reason is not None and expected in reason, (expected, reason)


def test_a_captured_update_pads_to_the_fewest_shapes_within_its_padding(caplog):
    """Without train.batch_shapes, a captured update's batches take the fewest of at most CAPTURE_SHAPES shapes
    whose pairs pad at most CAPTURE_PADDING of their tokens, and the log says how many and how much; given
    train.batch_shapes wins; an eager run keeps length-bucketed batches."""
    src_lens, tgt_lens = correlated_lengths(3000, seed=11)
    t = TrainConfig(batch_tokens=4000)
    with caplog.at_level("INFO", logger="app.data.schedule"):
        captured = training_schedule(t, src_lens, tgt_lens, 1, 0, 1, cuda=True, captured=True)
    assert captured.shapes is not None and 1 < captured.shape_count <= CAPTURE_SHAPES
    assert captured.shapes.pair_padding <= CAPTURE_PADDING
    assert BatchShapes(src_lens, tgt_lens, captured.shape_count - 1).pair_padding > CAPTURE_PADDING  # the fewest
    (info,) = caplog.records
    message = info.getMessage()
    assert f"train.capture: at most {CAPTURE_SHAPES} batch shapes padding at most {CAPTURE_PADDING:g}" in message
    assert f"one of {captured.shape_count} (source, target) lengths" in message
    given = TrainConfig(batch_tokens=4000, batch_shapes=4)
    assert training_schedule(given, src_lens, tgt_lens, 1, 0, 1, cuda=True, captured=True).shape_count == 4
    assert training_schedule(t, src_lens, tgt_lens, 1, 0, 1, cuda=True).shapes is None


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_the_schedule_fills_the_learning_rate_a_replay_reads_in_place(transformer):
    """A replayed fused AdamW reads the learning rate from one device tensor: the scheduler must write each
    update's rate into that same tensor, never a new one. A state saved with it reads back as a float."""
    cfg = compose_config("train.warmup_steps=4", "train.lr=0.002")
    optimizer, scheduler = make_optimizer(transformer, cfg)
    learning_rate_on_device(optimizer, torch.device("cpu"))
    rate = optimizer.param_groups[0]["lr"]
    assert isinstance(rate, torch.Tensor) and optimizer.param_groups[0]["capturable"]
    seen = []
    for _ in range(6):
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] is rate
        seen.append(float(rate))
    # inverse square root: warm-up to 0.002 at step 4, then 0.002 * sqrt(4 / (step + 1))
    expected = [min((s + 1) / 4, (4 / (s + 1)) ** 0.5) * 0.002 for s in range(1, 7)]
    assert seen == pytest.approx(expected, rel=1e-6)
    assert float(scheduler.get_last_lr()[0]) == pytest.approx(expected[-1], rel=1e-6)

    saved = optimizer.state_dict()
    fresh, _ = make_optimizer(transformer, cfg)
    fresh.load_state_dict(saved)
    assert isinstance(fresh.param_groups[0]["lr"], torch.Tensor)
    learning_rate_on_host(fresh)
    assert fresh.param_groups[0]["lr"] == pytest.approx(expected[-1], rel=1e-6)
    assert fresh.param_groups[0]["capturable"] is False  # an eager run's AdamW, as the optimizer makes it


def test_the_window_keeps_the_last_updates_grad_norm_when_its_graph_output_is_rewritten():
    """A replayed graph writes its outputs into the same tensors each time: the window copies the gradient norm
    it is given instead of holding the tensor, which the next replay of that shape would change."""
    window = MetricsWindow(torch.device("cpu"))
    outputs = StepResult(
        torch.tensor(12.0), torch.tensor(2.5), torch.tensor(True), torch.tensor(0.0), None, torch.tensor(11.0)
    )
    window.add(outputs, local_tokens=4, update_tokens=4)
    outputs.grad_norm.fill_(9.0)  # the next replay of this shape, not yet added
    outputs.loss_sum.fill_(99.0)
    values = window.summary()
    assert values["grad_norm"] == 2.5 and values["loss"] == 3.0 and values["nll_loss"] == 2.75
