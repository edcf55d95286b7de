"""Subword regularization (train.subword_alpha): sampled segmentations spell the same sentences, each epoch draws
one per pair from (seed, epoch) alone, batches are cut by the epoch's own lengths, training reads them, a resumed
run replays them exactly, and settings that cannot go with it are refused in one line."""

import os
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import TINY, compose_config, run_cli
from test_reliability import step_losses

from app.config.schema import Config, TrainConfig
from app.data.schedule import BatchSchedule
from app.data.subword_sampling import TrainSegmentations
from app.run.errors import UserError
from app.train.decay_end import DecayEnd
from app.train.update import make_optimizer


def segmentations(pairs=50, variants=4, seed=7) -> TrainSegmentations:
    """Made-up rows whose lengths tell variant and pair apart: variant v of pair i has i % 9 + 1 + v pieces."""
    rng = np.random.default_rng(0)
    lens = [(i % 9) + 1 + v for v in range(variants) for i in range(pairs)]
    src = pa.chunked_array([pa.array([list(rng.integers(4, 50, n)) for n in lens], type=pa.list_(pa.int32()))])
    lengths = np.asarray(lens, dtype=np.int64)
    return TrainSegmentations(src, src, lengths, lengths + 1, pairs, variants, seed, (5.0, 6.0))


def test_each_epoch_draws_one_variant_per_pair_from_seed_and_epoch_alone():
    seg = segmentations()
    rows = seg.rows(3)
    assert sorted(rows % seg.pairs) == list(range(seg.pairs))  # every pair once
    assert set(rows // seg.pairs) == {0, 1, 2, 3}  # from every variant
    assert np.array_equal(rows, segmentations().rows(3))  # another object, same (seed, epoch): the same draw
    assert not np.array_equal(rows, seg.rows(4))
    assert not np.array_equal(rows, segmentations(seed=8).rows(3))
    src_lens, tgt_lens = seg.lengths(3)
    assert np.array_equal(src_lens, seg.src_lens[rows]) and np.array_equal(tgt_lens, src_lens + 1)
    assert seg.rows_of(3, [5, 0]) == [int(rows[5]), int(rows[0])]
    negative = segmentations(seed=-1).rows(3)  # train.seed=-1 trains without sampling: with it too (a ValueError)
    assert sorted(negative % seg.pairs) == list(range(seg.pairs)) and not np.array_equal(negative, rows)


def test_one_variant_is_the_split_itself():
    seg = segmentations(variants=1)
    assert np.array_equal(seg.rows(0), np.arange(seg.pairs)) and np.array_equal(seg.rows(9), seg.rows(0))
    indices = [3, 1]
    assert seg.rows_of(5, indices) is indices  # as they are: a fixed-shape batch keeps its shape


def test_batches_are_cut_by_each_epochs_lengths():
    seg = segmentations(pairs=200, variants=4)
    schedule = BatchSchedule(*seg.lengths(0), 120, seed=3, epoch_lengths=seg.lengths)
    updates = iter(schedule)
    for epoch in (0, 1):
        src_lens, tgt_lens = seg.lengths(epoch)
        batches = schedule.epoch_batches(epoch, 120)
        assert sorted(i for b in batches for i in b) == list(range(seg.pairs))
        for batch in batches:
            padded = len(batch) * (src_lens[batch].max() + 1 + tgt_lens[batch].max() + 1)
            assert padded <= 120 or len(batch) == 1
        for batch in batches:  # the loss normalizer counts this epoch's target pieces
            update = next(updates)
            assert update.epoch == epoch and update.parts == [batch]
            assert update.tgt_tokens == int((tgt_lens[batch] + 1).sum())
    cut = schedule.cut([batches[0]], 1)
    assert sorted(i for piece in cut for i in piece) == sorted(batches[0])


def updates_per_epoch(schedule: BatchSchedule, epochs: int) -> list[int]:
    """The updates of each of the first ``epochs`` epochs, the schedule advanced through them as a run's loop is
    until train.max_epochs stops it."""
    per_epoch = [0] * epochs
    for update in schedule:
        schedule.advance(update)
        per_epoch[update.epoch] += 1
        if schedule.epochs_finished() == epochs:
            break
    return per_epoch


def test_a_decay_to_the_end_of_the_epochs_ends_with_their_last_update():
    """Each epoch's own segmentations cut it into its own number of batches: 33, 31 and 32 here. train.max_epochs=3
    counted as 3 × the first epoch's 33 updates, a linear decay ended at step 99, after the run's last update (96);
    with longer later epochs a run trained its last updates at the floor. It ends with the last update, counted
    without displacing the epoch the loop starts on from the schedule's cache, or its lengths from their cache."""
    seg = segmentations(pairs=100, variants=4)
    schedule = BatchSchedule(*seg.lengths(0), 60, seed=3, epoch_lengths=seg.lengths)
    t = TrainConfig(lr=1e-3, warmup_steps=1, lr_schedule="linear", lr_floor=0.1, max_epochs=3)
    _, scheduler = make_optimizer(torch.nn.Linear(2, 2), Config(train=t))
    progress = SimpleNamespace(step=0, eval_seconds=0.0)
    trainer = SimpleNamespace(cfg=Config(train=t), scheduler=scheduler, schedule=schedule, progress=progress)
    rate = DecayEnd(SimpleNamespace(**vars(trainer), elapsed=lambda: 0.0)).rate
    assert schedule._epoch_cache is not None and schedule._epoch_cache[0][0] == 0 and list(seg._epochs) == [0]
    per_epoch = updates_per_epoch(schedule, 3)
    step = sum(per_epoch)  # the run's last
    assert per_epoch == [33, 31, 32] and rate is not None and rate.epochs_end == step == 96
    assert rate(step - 2) > 0.1 == pytest.approx(rate(step - 1))  # the last update (0-based step - 1) at the floor


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory, corpus_tsv):
    root = tmp_path_factory.mktemp("subword")
    (root / "corpus.tsv").write_bytes(corpus_tsv.read_bytes())
    return root


def trainer_in(root, *overrides):
    from app.train.trainer import build_trainer

    cwd = os.getcwd()
    os.chdir(root)  # the corpus settings name their files relative to where training runs
    try:
        return build_trainer(compose_config(*TINY, *overrides), quiet=True)
    finally:
        os.chdir(cwd)


def test_training_reads_sampled_spellings_of_its_sentences(tiny_corpus):
    trainer = trainer_in(tiny_corpus, "name=sampled", "train.subword_alpha=0.2", "train.subword_variants=3")
    seg, tokenizer = trainer.data.train, trainer.data.tokenizer
    assert seg.variants == 3 and len(seg.src) == 3 * seg.pairs
    best = trainer_in(tiny_corpus, "name=best").data.train
    texts = [tokenizer.src.decode(best.src[i].as_py()) for i in range(best.pairs)]
    differ = 0
    for row in range(len(seg.src)):  # every variant spells its sentence, in other pieces for most
        ids = seg.src[row].as_py()
        assert tokenizer.src.decode(ids) == texts[row % seg.pairs]
        differ += ids != best.src[row % seg.pairs].as_py()
    assert differ > len(seg.src) // 2
    assert seg.stats()["src_pieces_vs_best"] > 1.0

    update = next(iter(trainer.schedule))  # what the first update's batch holds: that epoch's variants
    ready = trainer.prepare(update)
    (indices,), (batch,) = ready.parts, ready.batches
    rows = seg.rows(update.epoch)[indices]
    for k, row in enumerate(rows):
        expected = seg.src[int(row)].as_py() + [3]  # + EOS
        assert batch.src[k, : len(expected)].tolist() == expected
    assert ready.local_tokens == int(seg.tgt_lens[rows].sum() + len(rows))

    again = trainer_in(tiny_corpus, "name=sampled_again", "train.subword_alpha=0.2", "train.subword_variants=3")
    assert again.data.train.src.equals(seg.src)  # read from the cache, not sampled anew


def test_a_trainer_decays_to_the_last_update_of_its_sampled_epochs(tiny_corpus):
    """The same through build_trainer on the tiny corpus: its sampled epochs (SentencePiece's samples differ from
    one process to the next) cut about 76 batches each, a few more or fewer, and the decay a trainer is built with
    ends with the last update its loop stops train.max_epochs at."""
    trainer = trainer_in(tiny_corpus, "name=sampled", "train.subword_alpha=0.2", "train.subword_variants=3",
                         "train.batch_tokens=300", "train.max_epochs=8", "train.lr_schedule=linear")  # fmt: skip
    schedule, rate = trainer.schedule, trainer.scheduler.lr_lambdas[0]
    assert schedule._epoch_cache[0][0] == 0 and list(trainer.data.train._epochs) == [0]
    per_epoch = updates_per_epoch(schedule, 8)
    step = sum(per_epoch)  # the run's last
    assert len(set(per_epoch)) > 1, per_epoch  # the epochs differ, or this shows nothing
    assert rate.epochs_end == step, per_epoch
    assert rate(step - 2) > rate.floor == rate(step - 1)


def test_bpe_dropout_spells_the_same_sentences_in_more_pieces(tiny_corpus):
    """With a BPE model SentencePiece drops merges with probability alpha: other pieces, more of them, the same text."""
    bpe = ["tokenizer.model_type=bpe", "tokenizer.vocab_size=300"]
    seg = trainer_in(tiny_corpus, "name=bpe", *bpe, "train.subword_alpha=0.1", "train.subword_variants=2").data.train
    data = trainer_in(tiny_corpus, "name=bpe_best", *bpe).data
    best, tokenizer = data.train, data.tokenizer
    assert "spm_bpe300" in tokenizer.src_path and seg.variants == 2
    differ = 0
    for row in range(len(seg.src)):
        pair = row % seg.pairs
        assert tokenizer.src.decode(seg.src[row].as_py()) == tokenizer.src.decode(best.src[pair].as_py())
        differ += seg.src[row].as_py() != best.src[pair].as_py()
    assert differ > len(seg.src) // 2
    # more pieces on the whole (a sentence can come out shorter: a dropped merge lets a later one apply elsewhere)
    assert seg.src_lens.sum() > 2 * best.src_lens.sum()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.subword_alpha=1.5"], "train.subword_alpha=1.5 must be in [0, 1]"),
        (["train.subword_alpha=0.2", "train.subword_nbest=1"], "train.subword_nbest=1: -1"),
        (["train.subword_alpha=0.2", "train.subword_variants=0"], "train.subword_variants=0 must be at least 1"),
        (["train.subword_alpha=0.2", "train.batch_shapes=4"], "does not go with train.batch_shapes=4"),
        (["train.subword_alpha=0.2", "train.align_weight=0.5"], "does not go with train.align_weight=0.5"),
    ],
)
def test_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        compose_config(*TINY, *overrides)


RUN = [a for a in TINY if not a.startswith(("train.eval_every", "train.save_every", "train.log_every", "name="))] + [
    "train.log_every=1",
    "train.eval_every=1000",
    "train.subword_alpha=0.2",
    "train.subword_variants=4",
]


@pytest.mark.fresh_interpreter
@pytest.mark.slow
def test_a_resumed_run_trains_on_the_same_segmentations(tiny_corpus):
    """Per-step losses of a run stopped at step 15 and resumed, against one run straight through: bit for bit,
    over epoch boundaries (an epoch is about ten batches here); a resume with another alpha is refused."""
    straight = run_cli(tiny_corpus, "command=train", *RUN, "name=straight", "train.max_steps=30")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = run_cli(tiny_corpus, "command=train", *RUN, "name=halves", "train.max_steps=15", "train.save_every=15")
    assert first.returncode == 0, first.stderr[-3000:]
    other = run_cli(tiny_corpus, "command=train", *RUN, "name=halves", "train.max_steps=30", "train.resume=true",
                    "train.subword_alpha=0.3")  # fmt: skip
    assert other.returncode != 0 and "Traceback" not in other.stderr
    assert "trained with train.subword_alpha=0.2 train.subword_nbest=-1 train.subword_variants=4" in other.stderr
    second = run_cli(tiny_corpus, "command=train", *RUN, "name=halves", "train.max_steps=30", "train.resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    full = step_losses(tiny_corpus / "checkpoints/straight/tb")
    resumed = step_losses(tiny_corpus / "checkpoints/halves/tb")
    assert sorted(full) == list(range(1, 31)) and resumed == full


@pytest.mark.slow
def test_two_ranks_train_on_the_segmentations_one_process_does(tmp_path, corpus_tsv):
    """Two gloo ranks, which sample the cache together (one builds it, the other waits and reads it), against one
    process accumulating the same two batches per update: the same losses at every step."""
    from test_distributed import EXACT, single, torchrun

    (tmp_path / "corpus.tsv").write_bytes(corpus_tsv.read_bytes())
    sampled = [*EXACT, "data.name=tiny_sampled", "train.max_steps=12", "train.subword_alpha=0.2"]
    ddp = torchrun(tmp_path, *sampled, "name=ddp")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    accumulated = single(tmp_path, *sampled, "name=accum", "train.accum_steps=2")
    assert accumulated.returncode == 0, accumulated.stderr[-3000:]
    assert (ddp.stdout + ddp.stderr).count("subword sampling: 8 segmentations of") == 1  # sampled once
    two, one = step_losses(tmp_path / "checkpoints/ddp/tb"), step_losses(tmp_path / "checkpoints/accum/tb")
    assert sorted(two) == sorted(one) == list(range(1, 13))
    for step in two:
        assert abs(two[step] - one[step]) <= 1e-5, (step, two[step], one[step])
