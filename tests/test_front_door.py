"""Measured at the front door (Note [measured at the front door] in
search/measured_choice.py): where the step runs here, the choice is made on
measured time and the report says which latency is measured and which simulated."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.search.measured_choice import SLOW
from magis_nb.timing import PairTiming


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
                                    for _ in range(3))

    def forward(self, x):
        for b in self.layers:
            x = x + b(x)
        return x


def _case():
    torch.manual_seed(0)
    return Net(), (torch.randn(256, 32), torch.randn(256, 32))


@pytest.fixture(scope="module")
def res():
    model, inputs = _case()
    return magis_nb.optimize(model, inputs, loss_fn=F.mse_loss, time_budget=20, max_states=40,
                             mem_budget=0.9)


class FakeTimer:
    """Times nothing: each plan's ratio is given, by its simulated latency's rank."""

    def __init__(self, ratio_of):
        self.ratio_of, self.reps, self.calls = ratio_of, 3, []

    def pairs_for(self, seconds, plans):
        return 3

    def __call__(self, module, reps=None):
        self.calls.append(module)
        r = self.ratio_of(module)
        return PairTiming(0.0, r * 1e-3, 1e-3, [r, r, r])


def test_the_chosen_plan_is_timed_and_the_report_says_which_time_is_which(res):
    t = res.measured_time
    assert t is not None and len(t.ratios) >= 3 and all(r > 0 for r in t.ratios)
    assert res.time_ratio == t.ratio
    assert f"step measured x{t.ratio:.2f} of eager's" in res.message
    table = res.table()
    assert "measured x time" in table and "sim. latency ms" in table
    assert f"| {t.ratio:.3f} |" in table            # the after row's measured column
    assert "step time: measured x" in table
    html = res._repr_html_()
    assert "step time" in html and "simulated latency" in html
    assert res.timings["timing"] > 0 and res.seconds >= sum(res.timings.values()) - 1e-6
    # timing trained nothing for good: the user's model has no gradients
    assert res.summary()[1]["measured_time_ratio"] == round(t.ratio, 3)


def test_a_memory_budget_gets_the_fastest_measured_of_the_plans_under_it(res):
    under = sorted((p for p in res.pareto if p.peak <= 0.9 * res.reference_peak),
                   key=lambda p: p.latency)
    assert len(under) >= 2, [p.applied for p in res.pareto]
    # the second fastest by simulation measures fastest
    second = under[1]

    def ratio_of(module):
        plan = res.plan_for_module(module)
        return 0.5 if plan is second else 1.0

    saved = res.timer, dict(res.times)
    res.timer, res.times = FakeTimer(ratio_of), {}
    try:
        plan = res.select(mem_budget=0.9)
        assert plan is second and res.met and res.time_ratio == 0.5
        assert "the fastest measured of" in res.message
    finally:
        res.timer, res.times = saved
        res.select(mem_budget=0.9)


def test_a_slow_plan_is_said_to_be_slow(res):
    saved = res.timer, dict(res.times)
    res.timer, res.times = FakeTimer(lambda m: 2.0), {}
    try:
        res.select(mem_budget=0.9)
        assert res.time_ratio == 2.0 > SLOW
        assert "SLOW" in res.message and "2.0 times as long as running the model eagerly" \
            in res.message
        assert "SLOW" in res.table()
    finally:
        res.timer, res.times = saved
        res.select(mem_budget=0.9)


def test_a_latency_budget_holds_on_measured_time(res):
    saved = res.timer, dict(res.times)
    fastest = min(res.pareto, key=lambda p: p.latency)
    # only the simulated fastest plan is within x1.10 of eager, measured
    res.timer = FakeTimer(lambda m: 1.0 if res.plan_for_module(m) is fastest else 1.5)
    res.times = {}
    try:
        plan = res.select(lat_budget=1.10)
        assert plan is fastest and res.met and res.budget_kind == "lat"
        assert res.message.startswith("measured latency budget x1.10 met")
    finally:
        res.timer, res.times = saved
        res.select(mem_budget=0.9)


def test_without_timing_the_latency_is_said_to_be_simulated():
    model, inputs = _case()
    res = magis_nb.optimize(model, inputs, loss_fn=F.mse_loss, time_budget=10, max_states=10,
                            measure_time=False)
    assert res.timer is None and res.measured_time is None and not res.times
    assert "simulated only" in res.table() and "step measured" not in res.message
    planned = magis_nb.optimize(model, inputs, loss_fn=F.mse_loss, time_budget=10, max_states=10,
                                device_profile="h100")
    assert planned.timer is None and "planned for h100, not timed" in planned.table()
    with pytest.raises(ValueError, match="cannot time plans here"):
        magis_nb.optimize(model, inputs, loss_fn=F.mse_loss, time_budget=5, max_states=5,
                          device_profile="h100", measure_time=True)
    assert all(p.grad is None for p in model.parameters())
