"""Token-budget batching and padding."""

import random

import pytest
import torch

from app.data.batching import Batcher, _numpy, make_batches
from app.data.tokenizer import BOS, EOS, PAD


def random_lengths(n, seed, low=1, high=60):
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)], [rng.randint(low, high) for _ in range(n)]


def cost(batch, src_lens, tgt_lens):
    max_src = max(src_lens[i] for i in batch) + 1
    max_tgt = max(tgt_lens[i] for i in batch) + 1 if tgt_lens is not None else 0
    return len(batch) * (max_src + max_tgt)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("budget", [50, 300, 1000, 5000])
def test_every_index_once_and_within_budget(shuffle, budget):
    src_lens, tgt_lens = random_lengths(1000, seed=budget)
    src_lens[7], tgt_lens[7] = 400, 500  # longer than the smaller budgets on its own
    batches = make_batches(src_lens, tgt_lens, budget, shuffle=shuffle, seed=3, epoch=1)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(1000))
    assert all(batches)
    for batch in batches:
        assert len(batch) == 1 or cost(batch, src_lens, tgt_lens) <= budget
    if budget == 50:
        assert [7] in batches  # the oversized pair gets a batch of its own
    if budget >= 1000:
        assert sum(len(b) for b in batches) / len(batches) > 5  # batches are actually filled


def test_batches_are_reasonably_full():
    # sorting by length keeps padding low when source and target lengths go together, as in real data
    rng = random.Random(1)
    src_lens = [rng.randint(1, 60) for _ in range(2000)]
    tgt_lens = [max(1, round(n * rng.uniform(0.8, 1.25))) for n in src_lens]
    budget = 2000
    batches = make_batches(src_lens, tgt_lens, budget)
    padded = sum(cost(b, src_lens, tgt_lens) for b in batches)
    real = sum(src_lens[i] + 1 + tgt_lens[i] + 1 for i in range(2000))
    # sorted by the longer side, both sides of a batch are bounded: 7.0 % padding here (sorted by
    # target length alone: 9.4 %)
    assert padded < 1.08 * real
    # and the budget is used: on average at least half of it per batch
    assert padded / len(batches) > budget / 2


def test_source_only_budget():
    src_lens = [5, 9, 3, 20, 7, 7, 1, 12]
    batches = make_batches(src_lens, None, 30)
    assert sorted(i for b in batches for i in b) == list(range(len(src_lens)))
    for b in batches:
        assert len(b) == 1 or len(b) * (max(src_lens[i] for i in b) + 1) <= 30
    # unshuffled: in order of length
    assert [src_lens[i] for b in batches for i in b] == sorted(src_lens)


def test_empty_input():
    assert make_batches([], [], 100) == []


def test_same_seed_and_epoch_same_batches_other_epoch_other_order():
    src_lens, tgt_lens = random_lengths(500, seed=9, high=10)  # many ties: shuffling breaks them
    a = make_batches(src_lens, tgt_lens, 200, shuffle=True, seed=5, epoch=2)
    b = make_batches(src_lens, tgt_lens, 200, shuffle=True, seed=5, epoch=2)
    c = make_batches(src_lens, tgt_lens, 200, shuffle=True, seed=5, epoch=3)
    d = make_batches(src_lens, tgt_lens, 200, shuffle=True, seed=6, epoch=2)
    assert a == b
    assert a != c and a != d
    assert [i for x in a for i in x] != [i for x in c for i in x]  # the order differs, not just the grouping
    assert sorted(i for x in c for i in x) == list(range(500))


def test_unshuffled_is_independent_of_seed():
    src_lens, tgt_lens = random_lengths(200, seed=2)
    assert make_batches(src_lens, tgt_lens, 400, seed=1, epoch=0) == make_batches(
        src_lens, tgt_lens, 400, seed=7, epoch=9
    )


def test_batcher_shapes_bos_eos_and_padding():
    src = [[10, 11, 12], [20], [30, 31]]
    tgt = [[40], [50, 51, 52, 53], [60, 61]]
    batch = Batcher(src, tgt)([0, 1])
    assert batch.src.size(0) == 2
    assert batch.index.tolist() == [0, 1]
    assert batch.src.dtype == torch.long
    assert batch.src.tolist() == [[10, 11, 12, EOS], [20, EOS, PAD, PAD]]
    assert batch.tgt_in.tolist() == [[BOS, 40, PAD, PAD, PAD], [BOS, 50, 51, 52, 53]]
    assert batch.tgt_out.tolist() == [[40, EOS, PAD, PAD, PAD], [50, 51, 52, 53, EOS]]
    assert batch.src_lengths.tolist() == [4, 2] and batch.src_lengths.device.type == "cpu"  # with EOS
    assert batch.to(torch.device("cpu")).src_lengths is batch.src_lengths  # stays on the host
    # tgt_out is tgt_in shifted left by one wherever tgt_in is not padding
    assert torch.equal(
        batch.tgt_in[:, 1:][batch.tgt_in[:, 1:] != PAD], batch.tgt_out[:, :-1][batch.tgt_in[:, 1:] != PAD]
    )


def test_batcher_order_follows_indices_and_shapes_follow_longest():
    src = [[1 + 4] * n for n in (3, 7, 2, 5)]
    tgt = [[9] * n for n in (4, 1, 6, 2)]
    batcher = Batcher(src, tgt)
    batch = batcher([3, 0, 2])
    assert batch.index.tolist() == [3, 0, 2]
    assert tuple(batch.src.shape) == (3, 5 + 1)
    assert tuple(batch.tgt_in.shape) == tuple(batch.tgt_out.shape) == (3, 6 + 1)
    assert (batch.src != PAD).sum(dim=1).tolist() == [6, 4, 3]
    assert (batch.tgt_out != PAD).sum(dim=1).tolist() == [3, 5, 7]
    assert (batch.tgt_out == EOS).sum().item() == 3 and (batch.tgt_in == BOS).sum().item() == 3
    assert (batch.tgt_in[:, 0] == BOS).all()


def test_batcher_source_only():
    batch = Batcher([[7, 8], [9]])([1, 0])
    assert batch.src.tolist() == [[9, EOS, PAD], [7, 8, EOS]]
    assert batch.tgt_in is None and batch.tgt_out is None
    moved = batch.to(torch.device("cpu"))
    assert moved.tgt_in is None and torch.equal(moved.src, batch.src)


def test_a_sliced_arrow_column_of_several_chunks_pads_as_its_lists_do():
    """A memory-mapped split is a chunked Arrow column, often a slice of a larger one: its offsets start
    past zero, in each chunk and in the values the lists share."""
    import pyarrow as pa

    rng = random.Random(1)
    src = [[rng.randint(4, 99) for _ in range(rng.randint(0, 9))] for _ in range(40)]
    tgt = [[rng.randint(4, 99) for _ in range(rng.randint(0, 9))] for _ in range(40)]

    def column(lists):
        chunks = [pa.array(lists[:13], type=pa.list_(pa.int32())), pa.array(lists[13:], type=pa.list_(pa.int32()))]
        return pa.chunked_array(chunks).slice(5, 30)

    indices = [29, 0, 7, 8, 12, 3]  # across both chunks, first and last rows of the slice
    from_arrow, from_lists = Batcher(column(src), column(tgt))(indices), Batcher(src[5:35], tgt[5:35])(indices)
    for name in ("src", "tgt_in", "tgt_out", "index", "src_lengths"):
        assert torch.equal(getattr(from_arrow, name), getattr(from_lists, name)), name
    assert from_lists.src[1, : len(src[5])].tolist() == src[5]
    # a take's arrays start at offset 0; the reader still honours a slice's own offset
    assert _numpy(pa.array([3, 1, 4, 1, 5], type=pa.int32()).slice(2, 2)).tolist() == [4, 1]


def test_batching_a_translation_does_not_import_pandas():
    """pandas takes 0.4-0.6 s to import on a CPU; translating and serving read no table (training does,
    through datasets), so they never import it."""
    import subprocess
    import sys

    script = (
        "import sys; from app.data.batching import Batcher; "
        "Batcher([[5, 6], [7]], [[8], [9, 10]])([1, 0]); Batcher([[5]])(range(1)); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pandas'))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[:300]


def test_make_batches_feed_batcher_end_to_end():
    rng = random.Random(0)
    src = [[rng.randint(4, 99) for _ in range(rng.randint(1, 30))] for _ in range(300)]
    tgt = [[rng.randint(4, 99) for _ in range(rng.randint(1, 30))] for _ in range(300)]
    batcher, budget = Batcher(src, tgt), 400
    seen = []
    for indices in make_batches([len(s) for s in src], [len(t) for t in tgt], budget, shuffle=True, seed=1, epoch=0):
        batch = batcher(indices)
        assert batch.src.size(0) == 1 or batch.src.numel() + batch.tgt_in.numel() <= budget
        for row, i in enumerate(batch.index.tolist()):
            assert batch.src[row, : len(src[i])].tolist() == src[i]
            assert batch.tgt_out[row, : len(tgt[i])].tolist() == tgt[i]
        seen += batch.index.tolist()
    assert sorted(seen) == list(range(300))


def test_unbucketed_batches_keep_the_budget_but_pad_more():
    rng = random.Random(0)
    src = [rng.randint(1, 60) for _ in range(2000)]
    tgt = [max(1, s + rng.randint(-5, 5)) for s in src]

    def padding(batches):
        real = sum(src[i] + tgt[i] + 2 for b in batches for i in b)
        padded = sum(len(b) * (max(src[i] for i in b) + max(tgt[i] for i in b) + 2) for b in batches)
        return 1 - real / padded

    bucketed = make_batches(src, tgt, 2000, shuffle=True, seed=1)
    unbucketed = make_batches(src, tgt, 2000, shuffle=True, seed=1, by_length=False)
    assert sorted(i for b in unbucketed for i in b) == list(range(2000))
    assert all(len(b) * (max(src[i] for i in b) + max(tgt[i] for i in b) + 2) <= 2000 for b in unbucketed if len(b) > 1)
    assert padding(bucketed) < 0.1 < 0.3 < padding(unbucketed)
