"""train.batch_shapes: every training batch padded to one of a fixed set of (sentences, source, target)
shapes, so CUDA graphs replay; every pair still trained on once an epoch, the loss unchanged by the
empty rows, the batches replayed on resume."""

import random

import numpy as np
import pytest
import torch
from conftest import Vocab, model_config

from app.config.schema import TrainConfig
from app.data.batching import Batcher, make_batches, padded_tokens
from app.data.schedule import BatchSchedule
from app.data.shapes import BatchShapes, ShapedBatch, choose_shapes
from app.data.tokenizer import BOS, EOS, PAD
from app.models import build_model, sequence_loss
from app.run.errors import UserError


def correlated_lengths(n, seed):
    """Source and target lengths that go together, as in real parallel data."""
    rng = random.Random(seed)
    src = [rng.randint(2, 70) for _ in range(n)]
    return src, [max(1, round(s * rng.uniform(0.8, 1.25))) for s in src]


def test_choose_shapes_known_answer():
    src = np.array([3] * 10 + [10] * 10 + [4])
    tgt = np.array([3] * 10 + [10] * 10 + [2])
    assert choose_shapes(src, tgt, 1) == [(10, 10)]  # the longest pair's box: every pair fits
    # (3, 3) saves 14 tokens on each of ten pairs; (4, 2) saves 14 on one
    assert choose_shapes(src, tgt, 2) == [(3, 3), (10, 10)]
    assert choose_shapes(src, tgt, 3) == [(3, 3), (4, 2), (10, 10)]  # no padding left
    assert choose_shapes(src, tgt, 9) == [(3, 3), (4, 2), (10, 10)]  # no more shapes than save tokens


def test_shape_padding_stops_at_the_fewest_shapes_within_it():
    src = np.array([3] * 10 + [10] * 10 + [4])
    tgt = np.array([3] * 10 + [10] * 10 + [2])
    # 266 real tokens: one shape pads them to 21 × 20 = 420 (36.7 % padding), two to 280 (5.0 %), three to 266
    assert choose_shapes(src, tgt, 9, max_padding=0.5) == [(10, 10)]
    assert choose_shapes(src, tgt, 9, max_padding=0.1) == [(3, 3), (10, 10)]
    assert choose_shapes(src, tgt, 9, max_padding=0.04) == [(3, 3), (4, 2), (10, 10)]
    assert choose_shapes(src, tgt, 1, max_padding=0.1) == [(10, 10)]  # K is the most, whatever the padding
    shapes = BatchShapes(src - 1, tgt - 1, 9, max_padding=0.1)  # BatchShapes adds EOS / BOS itself
    assert shapes.shapes == [(3, 3), (10, 10)] and shapes.pair_padding == pytest.approx(1 - 266 / 280)


def test_shape_padding_is_logged_and_a_missed_target_warned_about(caplog):
    from app.data.schedule import training_schedule

    src_lens, tgt_lens = correlated_lengths(3000, seed=8)
    with caplog.at_level("INFO", logger="app.data.schedule"):
        chosen = training_schedule(
            TrainConfig(batch_tokens=4000, batch_shapes=32, shape_padding=0.1), src_lens, tgt_lens, 1, 0, 1, cuda=True
        )
        (info,) = caplog.records
        assert "train.batch_shapes=32 train.shape_padding=0.1:" in info.getMessage()
        assert 1 < chosen.shape_count < 32 and chosen.shapes.pair_padding <= 0.1
        fewer = BatchShapes(src_lens, tgt_lens, chosen.shape_count - 1)
        assert fewer.pair_padding > 0.1  # the fewest shapes within the target
        caplog.clear()
        training_schedule(
            TrainConfig(batch_tokens=4000, batch_shapes=2, shape_padding=0.1), src_lens, tgt_lens, 1, 0, 1, cuda=True
        )
        assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
        assert "more than train.shape_padding=0.1" in caplog.records[1].getMessage()


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(batch_shapes=16, shape_padding=1.0), "train.shape_padding=1.0 must be in"),
        (dict(batch_shapes=16, shape_padding=-0.1), "train.shape_padding=-0.1 must be in"),
        (dict(shape_padding=0.1), "give train.batch_shapes=K"),
    ],
)
def test_bad_shape_padding_is_refused(settings, message):
    with pytest.raises(UserError, match=message):
        TrainConfig(**settings)


@pytest.mark.parametrize("budget", [300, 2000, 9000])
def test_every_pair_once_an_epoch_in_a_shape_it_fits(budget):
    src_lens, tgt_lens = correlated_lengths(3000, seed=budget)
    shapes = BatchShapes(src_lens, tgt_lens, 8)
    batches = shapes.batches(budget, shuffle=True, seed=5, epoch=2)
    assert sorted(i for b in batches for i in b) == list(range(3000))
    assert len({(b.src_len, b.tgt_len) for b in batches}) <= 8
    rows = {}
    for b in batches:
        assert 0 < len(b) <= b.rows and b.rows * (b.src_len + b.tgt_len) <= budget
        assert all(src_lens[i] + 1 <= b.src_len and tgt_lens[i] + 1 <= b.tgt_len for i in b)
        assert rows.setdefault((b.src_len, b.tgt_len), b.rows) == b.rows  # one row count per shape
    per_shape = {}
    for b in batches:
        per_shape.setdefault((b.src_len, b.tgt_len), []).append(b)
    for group in per_shape.values():  # a shape's batches are evenly filled: fewer empty rows than batches
        assert sum(b.rows - len(b) for b in group) < len(group)


def test_same_seed_and_epoch_same_batches_other_epoch_other_order():
    src_lens, tgt_lens = correlated_lengths(2000, seed=1)
    shapes = BatchShapes(src_lens, tgt_lens, 6)
    a, b = shapes.batches(3000, True, 7, 3), BatchShapes(src_lens, tgt_lens, 6).batches(3000, True, 7, 3)
    assert [list(x) for x in a] == [list(x) for x in b] and [x.shape for x in a] == [x.shape for x in b]
    other = shapes.batches(3000, True, 7, 4)
    assert [list(x) for x in a] != [list(x) for x in other]
    assert sorted(x.shape for x in a) == sorted(x.shape for x in other)  # the same shapes every epoch


def test_more_shapes_pad_less_and_sixteen_stay_near_unshaped_padding():
    src_lens, tgt_lens = correlated_lengths(5000, seed=3)
    src, tgt = np.asarray(src_lens) + 1, np.asarray(tgt_lens) + 1
    real = int(src.sum() + tgt.sum())

    def padding(batches):
        return 1 - real / sum(padded_tokens(b, src, tgt) for b in batches)

    by_count = [padding(BatchShapes(src_lens, tgt_lens, k).batches(8000)) for k in (2, 4, 8, 16)]
    assert by_count == sorted(by_count, reverse=True) and by_count[0] > 0.2
    unshaped = padding(make_batches(src_lens, tgt_lens, 8000))
    assert by_count[-1] < unshaped + 0.06


def test_batcher_pads_to_the_shape_with_empty_sentences():
    src, tgt = [[5, 6], [7, 8, 9]], [[10], [11, 12]]
    batch = Batcher(src, tgt)(ShapedBatch([1, 0], rows=4, src_len=6, tgt_len=5))
    assert batch.src.shape == (4, 6) and batch.tgt_in.shape == batch.tgt_out.shape == (4, 5)
    assert batch.src.tolist() == [[7, 8, 9, EOS, PAD, PAD], [5, 6, EOS, PAD, PAD, PAD]] + [[EOS] + [PAD] * 5] * 2
    assert batch.tgt_in.tolist() == [[BOS, 11, 12, PAD, PAD], [BOS, 10, PAD, PAD, PAD]] + [[BOS] + [PAD] * 4] * 2
    assert batch.tgt_out.tolist() == [[11, 12, EOS, PAD, PAD], [10, EOS, PAD, PAD, PAD]] + [[PAD] * 5] * 2
    assert batch.src_lengths.tolist() == [4, 3, 1, 1] and batch.index.tolist() == [1, 0]
    plain = Batcher(src, tgt)(np.array([1, 0]))  # an index array's own .shape is not a batch shape
    assert plain.src.shape == (2, 4) and plain.tgt_in.shape == (2, 3)


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_shaped_padding_leaves_the_loss_and_gradients_unchanged(arch):
    """Wider padding and empty rows are masked: the summed loss and every gradient match the batch padded
    to its own longest pair."""
    torch.manual_seed(0)
    sizes = (
        dict(attention="bahdanau", emb_dim=16, hidden=16)
        if arch == "rnn"
        else dict(
            d_model=16, heads=2, enc_layers=2, dec_layers=2, ff_dim=32, attention_dropout=0.0, activation_dropout=0.0
        )
    )
    model = build_model(model_config(arch=arch, dropout=0.0, **sizes), Vocab(30, 30)).double()
    gen = torch.Generator().manual_seed(1)
    src = [torch.randint(4, 30, (n,), generator=gen).tolist() for n in (5, 3, 7)]
    tgt = [torch.randint(4, 30, (n,), generator=gen).tolist() for n in (4, 6, 2)]
    batcher = Batcher(src, tgt)

    def loss_and_grads(indices):
        model.zero_grad()
        b = batcher(indices)
        loss = sequence_loss(model(b.src, b.tgt_in, src_lengths=b.src_lengths), b.tgt_out)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    exact_loss, exact_grads = loss_and_grads([0, 1, 2])
    shaped_loss, shaped_grads = loss_and_grads(ShapedBatch([0, 1, 2], rows=5, src_len=11, tgt_len=9))
    torch.testing.assert_close(shaped_loss, exact_loss)
    assert len(shaped_grads) == len(exact_grads)
    for shaped, exact in zip(shaped_grads, exact_grads):
        torch.testing.assert_close(shaped, exact)


def test_schedule_cuts_shaped_epochs_and_resume_keeps_the_shapes():
    src_lens, tgt_lens = correlated_lengths(600, seed=4)
    shapes = BatchShapes(src_lens, tgt_lens, 5)
    schedule = BatchSchedule(src_lens, tgt_lens, 1500, seed=3, shapes=shapes)
    updates = iter(schedule)
    first = [next(updates) for _ in range(4)]
    assert all(isinstance(part, ShapedBatch) for u in first for part in u.parts)
    assert first[0].tgt_tokens == sum(tgt_lens[i] + 1 for i in first[0].parts[0])  # empty rows count nothing
    schedule.advance(first[1])
    resumed = BatchSchedule(src_lens, tgt_lens, 1500, seed=3, shapes=BatchShapes(src_lens, tgt_lens, 5))
    resumed.load_state_dict(schedule.state_dict(), 1500, 1500)
    again = next(iter(resumed))
    assert list(again.parts[0]) == list(first[2].parts[0]) and again.parts[0].shape == first[2].parts[0].shape
    unshaped = BatchSchedule(src_lens, tgt_lens, 1500, seed=3)
    shaped_figures, unshaped_figures = schedule.epoch_stats(), unshaped.epoch_stats()
    assert shaped_figures["epoch_batch_shapes"] <= 5 < unshaped_figures["epoch_batch_shapes"]
    assert unshaped_figures["epoch_padding_ratio"] < shaped_figures["epoch_padding_ratio"] < 0.5
    with pytest.raises(UserError, match="train.batch_shapes"):
        unshaped.load_state_dict(schedule.state_dict(), 1500, 1500)


def test_negative_shape_count_is_refused():
    with pytest.raises(UserError, match="train.batch_shapes=-1"):
        TrainConfig(batch_shapes=-1)


@pytest.mark.slow
def test_training_sees_only_the_fixed_shapes_and_resumes_bit_exact(tmp_path, corpus_tsv, monkeypatch):
    """Through the real Trainer: every forward pass gets one of the chosen shapes, and a run stopped and
    resumed ends with the uninterrupted run's weights, bit for bit."""
    import shutil

    from conftest import TINY, compose_config

    import app.train.trainer as training
    from app.data.corpus import prepare_data

    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    monkeypatch.chdir(tmp_path)
    base = [a for a in TINY if not a.startswith(("train.eval_every", "train.save_every"))]

    def run(name, steps, *extra):
        cfg = compose_config(
            *base,
            f"run_dir={tmp_path / name}",
            "train.batch_shapes=3",
            "train.eval_every=0",
            "train.save_every=4",
            "train.batch_tokens=600",
            f"train.max_steps={steps}",
            *extra,
        )
        tokenizer = prepare_data(cfg)
        torch.manual_seed(0)  # the same initial weights in every run
        model, shapes = build_model(cfg.model, tokenizer), set()
        model.register_forward_hook(lambda m, inputs, out: shapes.add((*inputs[0].shape, inputs[1].shape[1])))
        training.train(cfg, model=model)
        return shapes

    shapes = run("full", 10)
    assert 2 <= len(shapes) <= 3 and len({rows for rows, _, _ in shapes}) == len(shapes)
    run("cut", 4)
    run("cut", 10, "train.resume=true")
    full = torch.load(tmp_path / "full" / "last.pt", weights_only=True)["model"]
    resumed = torch.load(tmp_path / "cut" / "last.pt", weights_only=True)["model"]
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)


def test_cuda_graphs_without_fixed_shapes_are_warned_about(caplog):
    from app.data.schedule import training_schedule

    src_lens, tgt_lens = correlated_lengths(800, seed=6)
    graphs = TrainConfig(batch_tokens=1500, compile=True, compile_mode="reduce-overhead")
    with caplog.at_level("INFO", logger="app.data.schedule"):
        training_schedule(graphs, src_lens, tgt_lens, 1, 0, 1, cuda=False)  # no CUDA graphs on a CPU
        assert not caplog.records
        training_schedule(graphs, src_lens, tgt_lens, 1, 0, 1, cuda=True)
        (warning,) = caplog.records
        assert warning.levelname == "WARNING" and "train.batch_shapes=16" in warning.getMessage()
        caplog.clear()
        shaped = TrainConfig(batch_tokens=1500, compile=True, compile_mode="reduce-overhead", batch_shapes=4)
        assert training_schedule(shaped, src_lens, tgt_lens, 1, 0, 1, cuda=True).shape_count == 4
        (info,) = caplog.records
        assert info.levelname == "INFO" and "one of 4 (source, target) lengths" in info.getMessage()
