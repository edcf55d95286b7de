"""Training faults, injected into the real training loop: non-finite losses, out-of-memory batches;
and checkpoint safety: atomic writes, weights_only loading, rotation, mismatch errors."""

import os
import shutil
import warnings
from unittest.mock import patch

import pytest
import torch
from conftest import TINY, Vocab, compose_config

import app.train.trainer as training
from app.config.load import check_compatible
from app.run.checkpoint import load_checkpoint, rotate_snapshots, save_checkpoint, snapshot_steps
from app.run.errors import UserError


def config(run_dir, *overrides):
    base = [a for a in TINY if not a.startswith(("name=", "train.eval_every", "train.save_every"))]
    return compose_config(
        *base, f"run_dir={run_dir}", "train.eval_every=1000", "train.save_every=1000", "train.log_every=5", *overrides
    )


@pytest.fixture
def workdir(tmp_path, corpus_tsv, monkeypatch):
    shutil.copy(corpus_tsv, tmp_path / "corpus.tsv")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def faulty(cfg, fault):
    """The real model of ``cfg``, with ``fault(call_number, output, src)`` applied to every training forward
    pass: what the tests hand the Trainer in place of the model it would build."""
    from app.data.corpus import prepare_data
    from app.models import build_model

    model, calls = build_model(cfg.model, prepare_data(cfg)), []

    def hook(module, inputs, output):
        if not module.training:
            return output
        calls.append(1)
        return fault(len(calls), output, inputs[0])

    model.register_forward_hook(hook)
    return model


def train_with(fault, *overrides):
    cfg = config(os.path.join(os.getcwd(), "run"), *overrides)
    return training.train(cfg, model=faulty(cfg, fault))


@pytest.mark.slow
def test_non_finite_updates_are_skipped_and_counted(workdir):
    summary = train_with(lambda n, out, src: out * float("nan") if n in (3, 4, 7) else out, "train.max_steps=12")
    assert summary["steps"] == 12 and summary["skipped_steps"] == 3
    state = torch.load(workdir / "run" / "last.pt", weights_only=True)
    assert all(torch.isfinite(p).all() for p in state["model"].values())
    assert state["optimizer"]["state"][0]["step"] == 9  # skipped updates leave Adam's step count alone


@pytest.mark.parametrize("fused", ["true", "false"])
def test_a_skipped_update_changes_no_parameter(fused):
    from app.data.batching import Batcher
    from app.models import build_model

    cfg = compose_config(
        "model=transformer_small",
        "model.d_model=16",
        "model.heads=2",
        "model.enc_layers=1",
        "model.dec_layers=1",
        "model.ff_dim=32",
        f"train.fused_optimizer={fused}",
    )
    model = build_model(cfg.model, Vocab(20, 20))
    optimizer, scheduler = training.make_optimizer(model, cfg)
    batch = Batcher([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]])([0, 1])
    training.train_step(model, [batch], 7, optimizer, scheduler, cfg, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = model.register_forward_hook(lambda m, i, out: out * float("inf"))
    assert not bool(training.train_step(model, [batch], 7, optimizer, scheduler, cfg, None).finite)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    handle.remove()
    assert bool(training.train_step(model, [batch], 7, optimizer, scheduler, cfg, None).finite) and not torch.equal(
        before["out_proj.weight"], model.state_dict()["out_proj.weight"]
    )


@pytest.mark.slow
def test_training_aborts_after_max_bad_steps_in_a_row(workdir):
    with pytest.raises(UserError, match=r"aborted at step \d+: \d+ updates in a row .*train.max_bad_steps=4"):
        nan_after_two = lambda n, out, src: out * float("nan") if n > 2 else out  # noqa: E731
        train_with(nan_after_two, "train.max_steps=50", "train.max_bad_steps=4")


def out_of_memory_over(sentences):
    def fault(n, out, src):
        if src.size(0) > sentences:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return out

    return fault


@pytest.mark.slow
def test_out_of_memory_names_the_batch_and_the_setting(workdir):
    with pytest.raises(UserError) as err:
        train_with(out_of_memory_over(8), "train.max_steps=5")
    message = str(err.value)
    assert "out of cpu memory at step 1" in message and "source (" in message
    assert "lower train.batch_tokens (now 2000)" in message and "train.oom_retry=true" in message


@pytest.mark.slow
def test_out_of_memory_retry_halves_the_budget_and_trains_on(workdir):
    summary = train_with(out_of_memory_over(8), "train.max_steps=10", "train.oom_retry=true")
    assert summary["steps"] == 10 and summary["batch_tokens"] < 2000
    assert (
        torch.load(workdir / "run" / "last.pt", weights_only=True)["schedule"]["batch_tokens"]
        == summary["batch_tokens"]
    )


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint(str(path), {"model": {"w": torch.ones(3)}, "config": {}, "vocab": {}})

    def torn_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full (injected)")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError):
        save_checkpoint(str(path), {"model": {"w": torch.zeros(3)}, "config": {}, "vocab": {}})
    assert torch.equal(load_checkpoint(str(path))["model"]["w"], torch.ones(3))
    assert os.listdir(tmp_path) == ["last.pt"]  # no temp file left behind


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_loading_refuses_a_malicious_pickle(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"model": Exploit(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(UserError, match="not a loadable checkpoint"):
        load_checkpoint(str(tmp_path / "evil.pt"))
    assert not marker.exists()


def test_a_file_torch_cannot_read_is_one_line_without_torchs_warnings(tmp_path, recwarn):
    """Bytes that open like a pickle of an unknown protocol (1 in 256 random files) made torch warn about its
    weights_only unpickler before our line; that warning goes with the refusal. A file that loads keeps torch's."""
    (tmp_path / "garbled.pt").write_bytes(b"\x80\xb9" + bytes(range(256)) * 4)
    with pytest.raises(UserError, match=r"garbled.pt: not a loadable checkpoint: not a file torch.save wrote$"):
        load_checkpoint(str(tmp_path / "garbled.pt"))
    assert [str(w.message) for w in recwarn] == []
    save_checkpoint(str(tmp_path / "good.pt"), {"model": {"w": torch.ones(2)}, "config": {}, "vocab": {}})

    def load_warning(*args, **kwargs):
        warnings.warn("kept", stacklevel=2)
        return {"model": {}, "config": {}, "vocab": {}}

    with pytest.warns(UserWarning, match="kept"), patch.object(torch, "load", side_effect=load_warning):
        assert load_checkpoint(str(tmp_path / "good.pt")) == {"model": {}, "config": {}, "vocab": {}}


def test_rotation_keeps_newest_and_best(tmp_path):
    for step in (10, 20, 30, 40, 50):
        (tmp_path / f"step_{step:07d}.pt").write_bytes(b"x")
    rotate_snapshots(str(tmp_path), keep_last=2, keep_best=1, validations=[[10, 5.0], [20, 9.0], [30, 7.0]])
    assert snapshot_steps(str(tmp_path)) == [20, 40, 50]
    rotate_snapshots(str(tmp_path), keep_last=0, keep_best=0, validations=[])
    assert snapshot_steps(str(tmp_path)) == []


def test_mismatched_checkpoint_names_what_differs():
    from app.config.schema import RNNConfig

    state = {"vocab": {"src": "a"}, "config": {"model": {"arch": "rnn", "hidden": 1024, "cell": "gru"}}}
    check_compatible(state, "x.pt", {"src": "a"}, RNNConfig(hidden=1024, cell="gru"))
    with pytest.raises(UserError, match=r"model.cell='gru' there, 'lstm' here; model.hidden=1024 there, 512 here"):
        check_compatible(state, "x.pt", {"src": "a"}, RNNConfig(hidden=512, cell="lstm"))
    with pytest.raises(UserError, match="another vocabulary"):
        check_compatible(state, "x.pt", {"src": "b"}, RNNConfig(hidden=1024, cell="gru"))
    # settings a caller leaves free (a fine-tuning run's dropout) are not compared
    check_compatible(state, "x.pt", {"src": "a"}, RNNConfig(hidden=1024, cell="gru", dropout=0.0), free=("dropout",))
    with pytest.raises(UserError, match="model.dropout=0.3 there, 0.0 here"):
        check_compatible(state, "x.pt", {"src": "a"}, RNNConfig(hidden=1024, cell="gru", dropout=0.0))


def test_a_checkpoint_of_another_family_names_only_the_family():
    from app.config.schema import TransformerConfig

    state = {"vocab": {"src": "a"}, "config": {"model": {"arch": "rnn", "hidden": 1024, "cell": "gru"}}}
    with pytest.raises(UserError, match=r"^x.pt: model settings differ from this run's: model.arch='rnn' there, "):
        check_compatible(state, "x.pt", {"src": "a"}, TransformerConfig())
    with pytest.raises(UserError, match=r"'transformer' here$"):
        check_compatible(state, "x.pt", {"src": "a"}, TransformerConfig())


def test_an_rnn_checkpoint_with_every_familys_keys_compares_only_rnn_settings():
    """Checkpoints written before the model schemas split hold the Transformer's keys too."""
    from app.config.schema import RNNConfig

    old = {"arch": "rnn", "hidden": 1024, "cell": "gru", "d_model": 256, "pos": "rope", "kv_heads": 2}
    state = {"vocab": {"src": "a"}, "config": {"model": old}}
    check_compatible(state, "x.pt", {"src": "a"}, RNNConfig(hidden=1024, cell="gru"))
    with pytest.raises(
        UserError, match=r"^x.pt: model settings differ from this run's: model.hidden=1024 there, 64 here$"
    ):
        check_compatible(state, "x.pt", {"src": "a"}, RNNConfig(hidden=64, cell="gru"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-3, 50.0, float("inf"), float("nan")])
def test_gradient_clipping_is_torchs_bit_for_bit(dtype, scale):
    """app.train.update.clip_gradients skips clip_grad_norm_'s per-gradient no-op .to; norm and clipped gradients
    must stay exactly torch's, non-finite ones included (a parameter without a gradient among them)."""
    from app.train.update import clip_gradients

    torch.manual_seed(0)
    theirs = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in [(7, 5), (5,), (3, 2, 4), (1,)]]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    for i, (a, b) in enumerate(zip(theirs, ours)):
        grad = torch.randn(a.shape, dtype=dtype) * (scale if i == 2 else 1.0)
        a.grad, b.grad = (None, None) if i == 1 else (grad.clone(), grad.clone())
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    norm = clip_gradients(ours, 1.0)
    assert torch.equal(norm, expected) or (norm.isnan() and expected.isnan())
    for a, b in zip(theirs, ours):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num())
