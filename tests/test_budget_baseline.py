"""The budget's baseline is eager's step as the user runs it (Note [the budget's
baseline] in search/optimize.py): their own checkpointing included, measured."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import magis_nb
from magis_nb.verify import Reference


class Checkpointed(nn.Module):
    """Six MLP blocks, each under torch.utils.checkpoint: eager keeps only the
    blocks' inputs, the captured program (checkpoints inlined) every activation."""

    def __init__(self, ck: bool = True):
        super().__init__()
        self.ck = ck
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(),
                                                  nn.Linear(256, 64)) for _ in range(6))

    def forward(self, x):
        for b in self.blocks:
            x = x + (checkpoint(b, x, use_reentrant=False) if self.ck else b(x))
        return x


def _case(ck=True):
    torch.manual_seed(0)
    return Checkpointed(ck), (torch.randn(1024, 64), torch.randn(1024, 64))


def _optimize(model, inputs, **kw):
    return magis_nb.optimize(model, inputs, loss_fn=F.mse_loss, time_budget=60,
                             max_states=30, **kw)


def test_a_checkpointed_model_gets_no_plan_above_its_eager_peak():
    model, inputs = _case()
    eager = Reference(model, inputs, F.mse_loss, "train").eager_peak
    for budget in (None, 0.5):
        res = _optimize(model, inputs, mem_budget=budget)
        assert res.eager_peak == eager == res.reference_peak
        # the capture inlined the checkpoints: the unoptimized program is above eager
        assert res.before.peak > 2 * eager
        # plans below the captured program but above eager's step were taken off
        # (within x1.10 of latency the lowest plans are; at half of eager the
        # fastest that fits is below eager to begin with)
        assert bool(res.over_eager) == (budget is None)
        assert all(peak > eager for _, peak in res.over_eager)
        assert res.measured.peak <= eager and res.plan.peak <= eager
        if budget == 0.5:   # met only at half of eager's step, and said in the message
            assert res.met == (res.measured.peak <= 0.5 * eager)
            assert res.budget == 0.5 * eager
        assert "of eager's step" in res.message and "of the captured program" in res.message
    table = res.table()
    assert "| eager |" in table and "x peak is of eager's measured step" in table


def test_without_checkpoints_the_ratios_are_of_the_same_step():
    model, inputs = _case(ck=False)
    res = _optimize(model, inputs, mem_budget=0.5)
    assert res.eager_peak == res.measured.eager_peak
    # eager and the captured program allocate alike here: one ratio is printed
    assert abs(res.before.peak - res.eager_peak) <= 0.01 * res.eager_peak
    assert "of the captured program" not in res.message
    assert res.mem_ratio == res.plan.peak / res.eager_peak


def test_without_eager_the_baseline_is_the_captured_program_and_says_so():
    model, inputs = _case()
    res = _optimize(model, inputs, mem_budget=0.5, verify=False)
    assert res.eager_peak is None and res.reference_peak == res.before.peak
    assert "of the captured program, simulated" in res.message
    assert "x peak is of the captured program" in res.table()


def test_when_no_plan_measures_below_eager_the_result_says_keep_eager(monkeypatch):
    """Eager's step made smaller than any plan (as a user's own, better
    checkpointing would be): nothing is returned as met, and the message says so."""
    model, inputs = _case(ck=False)
    real = Reference.__init__

    def smaller(self, *a, **k):
        real(self, *a, **k)
        self.eager_peak = 1024          # far below any plan
    monkeypatch.setattr(Reference, "__init__", smaller)
    res = _optimize(model, inputs, mem_budget=0.5)
    assert not res.met and res.plan in res.pareto
    assert "keep running the model eagerly" in res.message
    assert res.plan.peak == min(peak for _, peak in res.over_eager)
