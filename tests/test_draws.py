"""Note [the wide step draws eager's masks] (magis_nb/draws.py): eager's own
error is measured against a wider copy that draws eager's masks, so a dropout
model's spread is rounding, not dropout noise. CUDA's fused dropout draws other
masks per dtype; here the wide step is made to draw others by seeding it
differently, and the safety net must still refuse a wrong plan."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb.verify as verify
from magis_nb.draws import NotReplayable, RecordDraws, ReplayDraws
from magis_nb.program import trace
from magis_nb.verify import Reference


def dropout_mlp(dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64),
                          nn.Dropout(0.3), nn.Linear(64, 8)).to(dtype)
    x, y = torch.randn(16, 32, dtype=dtype), torch.randn(16, 8, dtype=dtype)
    return model, (x, y)


def _step(model, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_a_replayed_step_draws_the_recorded_masks_whatever_the_seed():
    model, (x, y) = dropout_mlp()
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    rec = RecordDraws()
    torch.manual_seed(0)
    with rec:
        want = _step(a, x, y)
    # the CPU's dropout draws with bernoulli_ (CUDA's with native_dropout)
    assert len(rec.draws) == 2 and {n for n, _ in rec.draws} <= {"bernoulli_", "native_dropout"}
    torch.manual_seed(1)                   # another seed: other masks, unless replayed
    rp = ReplayDraws(rec.draws)
    with rp:
        got = _step(b, x, y)
    rp.finish()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    wide = copy.deepcopy(model).double()
    with ReplayDraws(rec.draws):
        loss64, _ = _step(wide, x.double(), y.double())
    assert abs(loss64.item() - want[0].item()) < 1e-5 * abs(want[0].item())


def test_a_step_that_draws_otherwise_is_not_replayed():
    model, (x, y) = dropout_mlp()
    rec = RecordDraws()
    with rec:
        _step(copy.deepcopy(model), x, y)
    with pytest.raises(NotReplayable):
        with ReplayDraws(rec.draws[:1]):
            _step(copy.deepcopy(model), x, y)


def test_the_safety_net_sees_a_wrong_plan_of_a_dropout_model_whose_wide_copy_draws_otherwise(
        monkeypatch):
    """A bf16 dropout MLP (its wide copy is fp32) whose wide step draws other
    masks, as CUDA's does: without the replay its spread is dropout noise and
    gradients 10% off pass; with it the program passes and they fail."""
    model, inputs = dropout_mlp(torch.bfloat16)
    real = verify.eager_step

    def other_masks_when_wide(m, ins, loss_fn, mode):
        if next(m.parameters()).dtype == torch.float32:
            torch.manual_seed(12345)
        return real(m, ins, loss_fn, mode)
    monkeypatch.setattr(verify, "eager_step", other_masks_when_wide)
    prog = trace(model, inputs, loss_fn=F.mse_loss)

    def wrong(*args):
        loss = mod.step(*args)
        for p in model.parameters():
            p.grad.mul_(0.9)
        return loss

    tol = dict(rtol=1e-2, atol=1e-5, rel_atol=1e-2)
    blind = Reference(model, inputs, F.mse_loss, "train", replay_draws=False)
    mod = prog.module()
    assert blind.check(wrong, **tol, slack=blind.slack()).comparison.allclose  # the hole
    ref = Reference(model, inputs, F.mse_loss, "train", replay_draws=True)
    slack = ref.slack()
    assert slack and max(slack.values()) < max(blind.slack().values()) / 10
    assert ref.check(prog.module(), **tol, slack=slack).comparison.allclose
    mod = prog.module()
    assert not ref.check(wrong, **tol, slack=slack).comparison.allclose


def test_native_dropout_applies_the_recorded_mask_to_its_own_input():
    """CUDA's dropout op (callable on the CPU too): the replay keeps its mask and
    scales the input it is given, in that input's dtype."""
    x = torch.randn(64, 64)
    rec = RecordDraws()
    torch.manual_seed(0)
    with rec:
        out, mask = torch.ops.aten.native_dropout(x, 0.25, True)
    torch.manual_seed(7)
    with ReplayDraws(rec.draws):
        out64, mask64 = torch.ops.aten.native_dropout(x.double(), 0.25, True)
    assert torch.equal(mask64, mask) and out64.dtype == torch.float64
    torch.testing.assert_close(out64, x.double() * mask * (1 / 0.75), rtol=0, atol=0)
    torch.testing.assert_close(out64.float(), out, rtol=1e-6, atol=1e-6)
