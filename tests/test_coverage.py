"""The coverage mechanism (``model.coverage``, app/models/attention.py) and See et al.'s coverage loss
(``train.coverage_weight``, app/models/coverage.py): the loss by hand, the score that reads the coverage, the
state that carries it, the update that adds the loss, what training with it does to the attention, and the settings
it refuses. (Beam search, sampling, ensembles, prefixes, constraints and scoring run it as the families
``rnn_bahdanau_coverage`` and ``rnn_luong_concat_local_coverage`` of tests/test_beam_search.py; tests/test_compile.py
compiles its loop steps.)"""

import json
import shutil

import pytest
import torch
from conftest import TINY, Vocab, compose_config, model_config, run_cli
from test_beam_search import FAMILIES, real_model, sources
from test_config_errors import refusal
from toy_tasks import reversal_data

from app.config.schema import Config
from app.data.batching import Batcher
from app.data.tokenizer import BOS, PAD
from app.models import build_model
from app.models.attention import AdditiveAttention
from app.models.coverage import coverage_loss
from app.train.update import device_update, make_optimizer

COVERING = ["rnn_bahdanau_coverage", "rnn_luong_concat_local_coverage"]


def test_the_coverage_loss_by_hand():
    """α = (1, 0, 0), (0.5, 0.5, 0), (0, 0, 1), then (0.5, 0, 0.5) at a padded position: c_2 = (1, 0, 0) gives
    min = (0.5, 0, 0), c_3 = (1.5, 0.5, 0) gives 0; the padded row (which would add 0.5 + 0.5) counts nothing."""
    attention = torch.tensor([[[1.0, 0, 0], [0.5, 0.5, 0], [0, 0, 1], [0.5, 0, 0.5]]])
    assert coverage_loss(attention, torch.tensor([[5, 6, 7, PAD]])).item() == pytest.approx(0.5)
    assert coverage_loss(attention, torch.tensor([[5, 6, 7, 8]])).item() == pytest.approx(1.5)
    # the same piece attended twice costs a whole step; each piece once costs nothing
    assert coverage_loss(torch.tensor([[[0, 1.0], [0, 1]]]), torch.tensor([[5, 6]])).item() == pytest.approx(1.0)
    assert coverage_loss(torch.tensor([[[0, 1.0], [1, 0]]]), torch.tensor([[5, 6]])).item() == 0.0


def test_the_score_reads_the_coverage_and_without_it_is_bahdanaus():
    torch.manual_seed(0)
    covering, plain = AdditiveAttention(4, 4, 6, coverage=True), AdditiveAttention(4, 4, 6)
    plain.load_state_dict(covering.state_dict(), strict=False)
    assert not covering.w_c.any()  # it starts at 0: Bahdanau's score
    with torch.no_grad():
        covering.w_c.normal_()
    query, keys = torch.randn(2, 1, 4), covering.prepare(torch.randn(2, 5, 4))
    coverage = torch.tensor([[[0, 0, 2.0, 0, 0]], [[1.0, 0, 0, 0, 0]]])
    scores = covering.score(query, keys, coverage)
    with torch.no_grad():
        covering.w_c.zero_()
    assert torch.allclose(covering.score(query, keys, coverage), plain.score(query, keys))
    changed = (scores - plain.score(query, keys)).abs() > 1e-6
    assert changed.tolist() == [[[False, False, True, False, False]], [[True, False, False, False, False]]]
    with pytest.raises(ValueError, match="give it the coverage"):
        covering.score(query, keys)


def test_the_scores_gradient_reaches_the_coverage():
    torch.manual_seed(0)
    attention = AdditiveAttention(3, 3, 4, coverage=True).double()
    with torch.no_grad():
        attention.w_c.normal_()  # not its 0 at the start: the gradient would vanish
    query, keys = torch.randn(2, 1, 3, dtype=torch.float64), torch.randn(2, 4, 4, dtype=torch.float64)
    coverage = torch.rand(2, 1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, c: attention.score(q, keys, c), (query.requires_grad_(), coverage))


@pytest.mark.parametrize("family", COVERING)
def test_the_state_carries_the_running_sum_of_the_attention(family):
    """Teacher forcing ends with the coverage Σ_t α_t; one step at a time, each step's coverage is the sum so far,
    and a beam's reordering takes its rows along."""
    model, src = real_model(family), sources()
    memory = model.encode(src)
    tgt_in = torch.cat([torch.full((6, 1), BOS), torch.randint(4, 30, (6, 4))], 1)
    out, attention, final = model.decoder(memory, tgt_in, model.decoder.initial_state(memory), True)
    assert torch.allclose(final.coverage, attention.sum(1), atol=1e-6)
    state, total = None, torch.zeros(6, src.size(1))
    for t in range(tgt_in.size(1)):
        _, step_attention, state = model.step(memory, tgt_in[:, t], state, need_attention=True)
        total += step_attention[:, 0]
        assert torch.allclose(state.coverage, total, atol=1e-6)
    order = torch.tensor([5, 4, 3, 2, 1, 0])
    assert torch.equal(state.select(order).coverage, state.coverage[order])


@pytest.mark.parametrize("family", COVERING)
def test_with_its_weight_at_zero_the_mechanism_is_the_plain_attention(family):
    """w_c = 0: the same logits and attention as the model without the mechanism, with the same other weights;
    w_c = 1: the same first step (no coverage yet), then a different attention."""
    covering = real_model(family)
    settings = {k: v for k, v in FAMILIES[family].items() if k != "coverage"}
    plain = build_model(model_config(dropout=0.0, **settings), Vocab(30, 30)).eval()
    plain.load_state_dict(covering.state_dict(), strict=False)
    src, tgt_in = sources(), torch.cat([torch.full((6, 1), BOS), torch.randint(4, 30, (6, 5))], 1)
    w_c = next(w for name, w in covering.named_parameters() if name.endswith("w_c"))
    decoded = lambda model: model.decode(model.encode(src), tgt_in, need_attention=True)  # noqa: E731
    with torch.no_grad():
        logits, attention = decoded(plain)
        w_c.zero_()
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(decoded(covering), (logits, attention)))
        w_c.fill_(1.0)
        moved = (decoded(covering)[1] - attention).abs().amax((0, 2))
    assert moved[0] < 1e-6 and moved[1:].min() > 1e-4, moved  # an untrained map is near uniform: so is c_t


def reversal_batches(n_batches: int, size: int, seed: int):
    src, tgt = reversal_data(n_batches * size, seed)
    batcher = Batcher(src, tgt)
    return [batcher(list(range(i * size, (i + 1) * size))) for i in range(n_batches)]


def covering_config(weight: float) -> Config:
    model = model_config(arch="rnn", emb_dim=16, hidden=32, enc_layers=1, attention="bahdanau", coverage=True)
    cfg = Config(model=model)
    cfg.model.dropout, cfg.train.coverage_weight, cfg.train.label_smoothing = 0.0, weight, 0.0
    cfg.train.lr, cfg.train.warmup_steps = 3e-3, 0
    return cfg


def test_the_update_adds_the_weighted_coverage_loss_and_reports_it():
    """The update's gradient is that of (cross-entropy + λ · coverage loss) / target pieces, and it reports both
    sums apart."""
    batch = reversal_batches(1, 16, seed=3)[0]
    n_tokens = int((batch.tgt_out != PAD).sum())
    for weight in (0.0, 2.0):
        cfg = covering_config(weight)
        torch.manual_seed(0)
        model = build_model(cfg.model, Vocab(20, 20))
        logits, attention = model(batch.src, batch.tgt_in, alignment=True)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD)
        covered = coverage_loss(attention, batch.tgt_out)
        expected = torch.autograd.grad(ce + weight * covered / n_tokens, model.decoder.attention.w_c)[0]
        optimizer, _ = make_optimizer(model, cfg)
        cfg.train.clip_norm = 1e9  # the gradient as it is
        captured = {}
        model.decoder.attention.w_c.register_hook(lambda g, into=captured: into.setdefault("grad", g.clone()))
        result = device_update(model, [batch], n_tokens, optimizer, cfg, None)
        assert torch.allclose(captured["grad"], expected, atol=1e-6)
        assert result.loss_sum.item() == pytest.approx(ce.item() * n_tokens, rel=1e-5)
        if weight:
            assert result.coverage_loss.item() == pytest.approx(covered.item(), rel=1e-5)
        else:  # nothing made for it: each operator of an update is one more to issue
            assert result.coverage_loss is None


def held_out_coverage_loss(model) -> float:
    """The coverage loss per target piece of the teacher-forced attention on reversal pairs not trained on."""
    batch = reversal_batches(1, 200, seed=777)[0]
    with torch.no_grad():
        _, attention = model(batch.src, batch.tgt_in, alignment=True)
    return coverage_loss(attention, batch.tgt_out).item() / int((batch.tgt_out != PAD).sum())


def trained(weight: float):
    cfg = covering_config(weight)
    torch.manual_seed(0)
    model = build_model(cfg.model, Vocab(20, 20))
    optimizer, _ = make_optimizer(model, cfg)
    model.train()
    for batch in reversal_batches(300, 32, seed=0):
        device_update(model, [batch], int((batch.tgt_out != PAD).sum()), optimizer, cfg, None)
    return model.eval()


def test_training_with_the_coverage_loss_attends_again_less():
    """Reversing sequences of symbols attends each source piece once; the loss (λ = 1) gets there sooner than the
    same model, mechanism and all, trained on the cross-entropy alone (300 updates: 0.009 against 0.175 per piece
    when written; at 100 both were above 0.7)."""
    with_loss, without = held_out_coverage_loss(trained(1.0)), held_out_coverage_loss(trained(0.0))
    assert with_loss < 0.25 * without, (with_loss, without)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model=rnn_luong", "model.coverage=true"],
            "model.coverage=true adds the coverage to an additive score, v·tanh(W s + U h + w_c c): "
            "model.attention=bahdanau, or luong with model.score=concat (not model.score=general)",
        ),
        (
            ["model=rnn_plain", "model.coverage=true"],
            "model.coverage=true adds the coverage to an additive score, v·tanh(W s + U h + w_c c): "
            "model.attention=bahdanau, or luong with model.score=concat (model.attention=none has none)",
        ),
        (
            ["model=rnn_bahdanau", "train.coverage_weight=1"],
            "train.coverage_weight=1.0 trains the coverage mechanism: set model.coverage=true (an RNN with additive "
            "attention: model=rnn_bahdanau, or rnn_luong with model.score=concat)",
        ),
        (
            ["model=rnn_bahdanau", "model.coverage=true", "train.coverage_weight=-1"],
            "train.coverage_weight=-1.0 must be >= 0 (0: no coverage loss)",
        ),
    ],
)
def test_settings_it_cannot_work_with_are_refused_in_one_line(overrides, message):
    assert refusal(*overrides) == message


def test_a_transformer_has_no_coverage_setting():
    assert "model.coverage" in refusal("model.coverage=true")


RNN = [
    *(s for s in TINY if not s.startswith("model")),
    "model=rnn_bahdanau",
    "model.emb_dim=32",
    "model.hidden=32",
    "model.enc_layers=1",
]
COVERAGE = ["model.coverage=true", "train.coverage_weight=1", "train.init_from=tiny", "name=covered"]


@pytest.fixture(scope="module")
def covered(tmp_path_factory, corpus_tsv):
    """A 20-step Bahdanau run ``tiny``, then ``covered``: 10 steps more with the coverage added (See et al.'s
    recipe: the mechanism and its loss on a trained model), through the CLI."""
    root = tmp_path_factory.mktemp("coverage")
    shutil.copy(corpus_tsv, root / "corpus.tsv")
    for args in (["train.max_steps=20"], [*COVERAGE, "train.max_steps=10", "train.log_every=5"]):
        result = run_cli(root, "command=train", *RNN, *args)
        assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.slow
def test_fine_tuning_adds_the_coverage_to_a_trained_model_which_starts_as_it_was(covered, monkeypatch):
    from app.train.trainer import build_trainer

    monkeypatch.chdir(covered)
    trainer = build_trainer(compose_config(*RNN, *COVERAGE, "name=again", "train.eval_every=0"))
    trainer.writer.close()
    given = torch.load(covered / "checkpoints/tiny/best.pt", map_location="cpu", weights_only=True)["model"]
    weights = trainer.model.state_dict()
    assert set(weights) - set(given) == {"decoder.attention.w_c"}
    assert all(torch.equal(weights[k], v) for k, v in given.items())
    assert not weights["decoder.attention.w_c"].any()  # at 0: the trained model's attention, unchanged
    log = (covered / "checkpoints/covered/train.log").read_text()
    assert "fine-tuning turns model.coverage on: its new weights start at 0" in log
    trained = torch.load(covered / "checkpoints/covered/last.pt", map_location="cpu", weights_only=True)["model"]
    assert trained["decoder.attention.w_c"].any()  # trained by the coverage loss


@pytest.mark.slow
def test_the_coverage_loss_is_logged_and_eval_reads_the_re_attention(covered):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(covered / "checkpoints/covered/tb")).Reload()
    losses = [e.value for e in events.Scalars("train/coverage_loss")]
    assert len(losses) == 2 and all(0 <= x <= 1 for x in losses)
    result = run_cli(covered, "command=eval", *RNN, "name=covered", "decode.beam_size=2")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((covered / "checkpoints/covered/eval/test/metrics.json").read_text())
    assert 0 <= metrics["attention"]["reattention"] <= 1


@pytest.mark.slow
def test_a_run_cannot_drop_the_coverage_it_starts_from(covered):
    result = run_cli(covered, "command=train", *RNN, "train.init_from=covered", "name=dropped", "train.max_steps=1")
    assert result.returncode != 0
    assert "model.coverage=True there, False here" in result.stderr
