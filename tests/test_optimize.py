"""optimize(): budgets, feasibility in simulation and measurement, eager equality,
monotonic selection, progress, interruption, determinism, errors."""
import copy
import math

import pytest
import torch

import magis_nb
from magis_nb import zoo
from magis_nb.analysis import divisors
from magis_nb.search import Progress
from magis_nb.search.report import result_html
from magis_nb.verify import Reference

# Latency from a fixed GPU profile keeps the search deterministic (measured CPU
# costs vary run to run); the plans still run, and are measured, on this CPU.
PROFILE = "rtx3090"


@pytest.fixture(scope="module")
def gpt():
    return zoo.build("gpt", "tiny")


@pytest.fixture(scope="module")
def gpt_ref(gpt):
    return Reference(gpt.model, gpt.inputs, gpt.loss_fn, "train")


@pytest.fixture(scope="module")
def gpt_mem(gpt):
    return magis_nb.optimize(gpt.model, gpt.inputs, loss_fn=gpt.loss_fn, mem_budget=0.5,
                             device_profile=PROFILE, time_budget=120, max_states=40)


def test_feasible_plan_meets_its_budget_in_simulation_and_measurement(gpt, gpt_mem, gpt_ref):
    res = gpt_mem
    assert res.met and "met" in res.message
    # the budget is half of eager's step as measured (Note [the budget's baseline])
    assert res.eager_peak == gpt_ref.eager_peak
    assert res.plan.peak <= 0.5 * res.eager_peak
    chk = gpt_ref.check(res.module)
    assert chk.comparison.allclose, chk.comparison.mismatches
    # the measured peak is the simulated one (host buffers are not device memory)
    assert abs(chk.measured_peak - res.plan.peak) <= 0.03 * res.plan.peak
    assert chk.measured_peak <= 0.5 * res.eager_peak * 1.03


def test_every_pareto_plan_runs_like_eager(gpt_mem, gpt_ref):
    front = gpt_mem.pareto
    assert len(front) >= 2
    assert [p.peak for p in front] == sorted(p.peak for p in front)
    # non-dominated: latency falls as the peak rises
    assert all(a.latency > b.latency for a, b in zip(front, front[1:]))
    step = max(1, len(front) // 5)          # five plans across the front, both ends included
    for p in front[::step] + front[-1:]:
        chk = gpt_ref.check(gpt_mem.module_for(p))
        assert chk.comparison.allclose, (p, chk.comparison.mismatches)
        assert chk.measured_peak == p.peak


def test_select_is_monotonic_in_the_budget(gpt_mem):
    res = gpt_mem
    peaks = []
    for b in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1):
        plan = res.select(mem_budget=b)
        assert res.met == (plan.peak <= b * res.reference_peak)
        peaks.append(plan.peak)
    assert peaks == sorted(peaks, reverse=True)
    lats = [res.select(lat_budget=b).latency for b in (1.3, 1.2, 1.1, 1.05, 1.0)]
    assert lats == sorted(lats, reverse=True)
    res.select(mem_budget=0.5)


@pytest.mark.slow
def test_tighter_budget_searches_never_end_higher():
    case = zoo.build("mlp", "tiny")
    peaks = []
    for b in (0.9, 0.7, 0.5, 0.3):
        res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, mem_budget=b,
                                device_profile=PROFILE, time_budget=120, max_states=30)
        peaks.append(res.plan.peak)
    assert peaks == sorted(peaks, reverse=True)


# Since BatchNorm runs in phases (ir/phased_norm.py) the tiny U-Net's memory-budget
# search climbs through remats of 24-34 ops (0.43 at x1.20) and never visits the
# latency search's plan (remat 14; swap 7: 0.45 at x1.10). A regression of the
# search, kept visible here until the memory ladder is mended (strict: a fix fails
# this marker).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "unet"])
def test_memory_budget_search_is_as_cheap_as_the_latency_budget_search(name):
    """The peak a latency-budget search reaches at 1.10, asked for as a memory
    budget, costs about as much latency. The peak-first order alone paid x3.2
    (gpt) and x3.0 (unet) here: it reached the budget through the biggest rewrites."""
    case = zoo.build(name, "tiny")
    kw = dict(loss_fn=case.loss_fn, device_profile="rtx3090", time_budget=600, max_states=80)
    lat = magis_nb.optimize(case.model, case.inputs, lat_budget=1.10, **kw)
    mem = magis_nb.optimize(case.model, case.inputs, mem_budget=lat.mem_ratio, **kw)
    assert lat.met and mem.met
    assert mem.lat_ratio <= 1.10 * 1.02


def test_infeasible_budget_returns_the_lowest_peak_and_says_so(gpt_mem):
    """... or the fastest plan within 5% of the lowest peak, and says both."""
    res = gpt_mem
    plan = res.select(mem_budget=0.01)
    assert not res.met
    low = min(res.pareto, key=lambda p: (p.peak, p.latency))
    near = [p for p in res.pareto if p.peak <= 1.05 * low.peak]
    assert plan.latency == min(p.latency for p in near) and plan in near
    assert "NOT met" in res.message and f"{plan.peak / 2**20:.2f} MiB" in res.message
    assert f"lowest peak reached is {low.peak / 2**20:.2f} MiB" in res.message
    res.select(mem_budget=0.5)


def test_latency_budget_mode_and_inference():
    case = zoo.build("vit", "tiny")
    res = magis_nb.optimize(case.model, case.inputs[:-1], mode="infer", lat_budget=1.1,
                            device_profile=PROFILE, time_budget=120, max_states=15)
    assert res.met and res.plan.latency <= 1.1 * res.before.latency
    assert res.plan.peak <= res.before.peak
    out = res.module(*case.inputs[:-1])
    torch.testing.assert_close(out, case.model(*case.inputs[:-1]), rtol=1e-4, atol=1e-5)


def test_progress_is_reported_and_ends_with_done():
    case = zoo.build("mlp", "tiny")
    seen = []
    res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, mem_budget=0.6,
                            device_profile=PROFILE, time_budget=120, max_states=12,
                            progress=seen.append)
    assert seen and all(isinstance(p, Progress) for p in seen)
    assert seen[-1].done and not any(p.done for p in seen[:-1])
    assert seen[-1].states == res.states
    assert seen[-1].before_peak == res.reference_peak == res.eager_peak
    assert all(a.elapsed <= b.elapsed for a, b in zip(seen, seen[1:]))


def test_ctrl_c_returns_the_best_so_far():
    case = zoo.build("mlp", "tiny")
    calls = []

    def interrupt(p):
        calls.append(p)
        if len(calls) == 1:
            raise KeyboardInterrupt

    res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, mem_budget=0.5,
                            device_profile=PROFILE, time_budget=120, progress=interrupt)
    assert res.interrupted
    assert res.plan.peak <= res.before.peak
    chk = Reference(case.model, case.inputs, case.loss_fn, "train").check(res.module)
    assert chk.comparison.allclose


def test_same_seed_same_plan():
    case = zoo.build("mlp", "tiny")
    runs = [magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, mem_budget=0.5,
                              device_profile=PROFILE, time_budget=120, max_states=20, seed=3)
            for _ in range(2)]
    a, b = runs
    assert (a.plan.peak, a.plan.latency, a.plan.applied) == (b.plan.peak, b.plan.latency, b.plan.applied)
    assert a.module.code == b.module.code


def test_result_reports_what_was_applied(gpt_mem):
    res = gpt_mem
    p = res.plan
    assert p.applied != "re-order only"
    assert res.code == res.module.code and "def " in res.code
    rows = res.summary()
    assert [r["plan"] for r in rows] == ["before", "after"]
    tl = res.timeline()
    assert tl.peak == p.peak and max(tl.total) == p.peak
    assert p.swaps and max(tl.host) > 0     # the RTX 3090 plan swaps (remat 16; swap 4 when written)
    t = res.timings
    assert set(t) == {"capture", "analysis", "search"} and min(t.values()) > 0
    assert sum(t.values()) <= res.seconds
    # plans the search did not build for time are said so (a longer search may go lower)
    kept = res.too_big
    try:
        res.too_big = 0
        assert "not tried" not in result_html(res)
        res.too_big = 3
        assert "3 bigger plan(s) not tried" in result_html(res)
    finally:
        res.too_big = kept


def test_algebra_off_switch_reaches_the_search():
    """optimize(algebra=False) (%%magis --no-algebra) proposes no merge or sink."""
    from magis_nb.search.proposals import proposals
    case = zoo.build("gpt", "tiny")
    for on in (True, False):
        res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn,
                                device_profile=PROFILE, time_budget=60, max_states=2, algebra=on)
        space = res.builder.space
        root = space.evaluate((), (), space.program.graph)
        kinds = {r.rstrip("x0123456789") for r, *_ in proposals(space, root)}
        assert ({"merge", "sink"} <= kinds) == on, kinds


def test_bad_arguments_are_refused_with_a_hint(gpt):
    with pytest.raises(ValueError, match="not both"):
        magis_nb.optimize(gpt.model, gpt.inputs, loss_fn=gpt.loss_fn, mem_budget=0.5, lat_budget=1.1)
    with pytest.raises(ValueError, match="unknown device profile"):
        magis_nb.optimize(gpt.model, gpt.inputs, loss_fn=gpt.loss_fn, device_profile="tpu")
    with pytest.raises(ValueError, match="mode"):
        magis_nb.optimize(gpt.model, gpt.inputs, mode="eval")


def _fake_measure(res, factor):
    """measure(module) for fit_measured: the plan's simulated ratio times ``factor``
    (a program overhead the simulator does not see)."""
    def measure(mod):
        plan = res.plan_for_module(mod)
        return factor * plan.latency / res.before.latency
    return measure


def test_fit_measured_picks_the_lowest_peak_plan_that_measures_within_the_budget(gpt_mem):
    res = gpt_mem
    budget, factor = 1.10, 1.05
    pick = res.select(lat_budget=budget)       # the pick on simulated latency
    plan = res.fit_measured(_fake_measure(res, factor), budget, tries=len(res.pareto))
    fits = [p for p in res.pareto + res.refined if factor * p.latency / res.before.latency <= budget]
    assert fits and pick not in fits, "the simulated pick measures over; a faster plan fits"
    assert plan is min(fits, key=lambda p: (p.peak, p.latency))
    assert res.met and "measured latency budget x1.10 met" in res.message
    # select()'s pick first, then the fastest plan, then bisection between them
    assert res.fits[0][0] is pick
    assert res.fits[1][0] is min(res.pareto, key=lambda p: p.latency)
    assert len(res.fits) <= 2 + math.ceil(math.log2(len(res.pareto))) + \
        math.ceil(math.log2(len(res.refined) + 1))
    assert dict((id(p), r) for p, r in res.fits)[id(plan)] == pytest.approx(
        factor * plan.latency / res.before.latency)
    res.select(mem_budget=0.5)


def test_fit_measured_refines_between_two_splits_the_front_skips(gpt, gpt_mem):
    """A front with nothing between the unsplit plan and a split in 8 (as on a CPU,
    where smaller splits can simulate slower and drop off it): fit_measured builds
    the splits in between and bisects among them on measured time."""
    res = copy.copy(gpt_mem)
    res.forget_modules()
    res.pareto = list(res.pareto)
    sp = res.builder.space
    top = max((c for c in sp.cands if not c.pack), key=lambda c: c.score)
    n_hi = max(d for d in divisors(top.max_n) if d <= 8)
    g, batches = sp.build(((top.id, n_hi),), ())
    hi = res.builder.plan_of(sp.evaluate(((top.id, n_hi),), batches, g))
    res.pareto = [hi, res.before]

    def n_of(p):
        return p.fission[0].n if p.fission else 1

    # a budget the split's simulated latency meets, so it is measured first
    budget = max(1.10, 1.01 * hi.latency / res.before.latency)

    def measure(mod):   # measured time rises with n: n <= 2 fits
        plan = res.plan_for_module(mod)
        return budget * (1 + 0.01 * (n_of(plan) - 2.5))

    plan = res.fit_measured(measure, budget)
    assert [n_of(p) for p in res.refined] == [d for d in divisors(top.max_n) if 1 < d < n_hi]
    assert res.met and n_of(plan) == 2
    assert plan in res.refined and plan.peak < res.before.peak
    assert [n_of(p) for p, _ in res.fits][:2] == [n_hi, 1]    # the front first, then between


def test_fit_measured_says_when_no_plan_measures_within_the_budget(gpt_mem):
    res = gpt_mem
    plan = res.fit_measured(_fake_measure(res, 3.0), 1.10, tries=5)
    assert not res.met and "NOT met" in res.message
    # select()'s pick, then the fastest plan: when that is over too, nothing fits
    assert [p for p, _ in res.fits] == [res.fits[0][0], min(res.pareto, key=lambda p: p.latency)]
    assert plan is res.fits[-1][0] and plan is min(res.fits, key=lambda t: t[1])[0]
    with pytest.raises(ValueError, match="positive"):
        res.fit_measured(_fake_measure(res, 1.0), 0)
    res.select(mem_budget=0.5)


def test_fission_false_leaves_every_region_whole():
    """`fission=False`: no F-Tree candidate, so no plan of the front splits a
    region (the search still recomputes and swaps); with fission the same
    search splits the whole step first."""
    case = zoo.build("gpt", "tiny")
    kw = dict(loss_fn=case.loss_fn, device_profile=PROFILE, time_budget=60, max_states=12)
    res = magis_nb.optimize(case.model, case.inputs, mem_budget=0.5, fission=False, **kw)
    assert all(not p.fission for p in res.pareto)
    assert any(p.swaps or p.remat for p in res.pareto)
    split = magis_nb.optimize(case.model, case.inputs, mem_budget=0.5, **kw)
    assert any(p.fission for p in split.pareto)
