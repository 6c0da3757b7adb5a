"""The peers harness (magis_nb/bench/peers_*.py) on tiny models: the result type,
the profiler peak against the storage tracker, allclose catching a wrong step,
checkpointing lowering the peak, the dominance computation."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from magis_nb import zoo
from magis_nb.bench import peers, peers_strategies as S
from magis_nb.bench.peers_harness import (Candidate, Reference, Result, add_ratios, dominated,
                                          measure, pareto)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def gpt():
    return zoo.build("gpt", "bench")  # the size `bench peers` runs: ~0.45 s a step


@pytest.fixture(scope="module")
def gpt_rows(gpt):
    ref = Reference.of(gpt)
    rows = measure(gpt, "eager", S.eager, reps=1, ref=ref)
    rows += measure(gpt, "checkpoint", S.checkpointed, reps=1, ref=ref)
    add_ratios(rows)
    return rows


def test_result_row_is_the_json_schema(gpt_rows):
    row = gpt_rows[0].row()
    for key in ("model", "strategy", "setting", "peak", "time", "peak_ratio", "time_ratio",
                "allclose", "error"):
        assert key in row
    json.dumps(row)
    assert Result(**row) == gpt_rows[0]
    eager = gpt_rows[0]
    assert eager.strategy == "eager" and eager.error is None and eager.allclose is True
    assert eager.peak_ratio == 1.0 and eager.time > 0 and eager.time_ratio == 1.0


def test_profiler_peak_agrees_with_tracker(gpt_rows):
    # Note [profiler peak]: same bytes up to kernels' scratch space
    for r in gpt_rows:
        assert r.tracker_peak and abs(r.peak - r.tracker_peak) / r.tracker_peak < 0.01, r


def test_checkpoint_lowers_peak_and_stays_allclose(gpt_rows):
    eager, ckpt = gpt_rows
    assert ckpt.setting == "4 blocks" and ckpt.allclose is True and ckpt.max_err < 1e-5
    assert ckpt.peak < 0.6 * eager.peak, (ckpt.peak, eager.peak)


def test_wrap_blocks_keeps_parameter_order():
    case = zoo.build("unet", "tiny")
    before = [id(p) for p in case.model.parameters()]
    assert S.wrap_blocks(case.model, S.BLOCKS["unet"]) == 9  # inc, 4 down, 4 dec
    assert [id(p) for p in case.model.parameters()] == before
    assert isinstance(case.model.down[2], S.Checkpointed)


def test_allclose_catches_a_wrong_step(gpt):
    ref = Reference.of(gpt)

    def make(case):
        m = S.fresh_copy(case)
        def step():  # eager, then one gradient is off by 1%
            loss = S.eager_step(m, case.inputs, case.loss_fn, "train")
            with torch.no_grad():
                next(m.parameters()).grad.mul_(1.01)
            return loss
        return [Candidate("wrong", step, list(m.parameters()), list(m.buffers()))]

    [r] = measure(gpt, "wrong", make, reps=1, ref=ref)
    assert r.allclose is False and r.max_err > 0 and r.error is None


def test_a_failing_strategy_is_a_row_with_the_reason(gpt):
    def make(case):
        raise ImportError("No module named 'rkgb.core'")

    [r] = measure(gpt, "rockmate", make, reps=1, ref=Reference.of(gpt))
    assert r.peak is None and r.error == "ImportError: No module named 'rkgb.core'"


def test_batchnorm_recompute_shows_in_buffers():
    # checkpoint re-runs BatchNorm's forward, so running stats move twice
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    case = zoo.ZooCase("bn", "tiny", model, (torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1])),
                       nn.functional.cross_entropy, torch.float32, "")

    def make(c):
        m = S.fresh_copy(c)
        params, bufs = list(m.parameters()), list(m.buffers())
        S.wrap_blocks(m, ("1",))
        return [Candidate("bn", lambda: S.eager_step(m, c.inputs, c.loss_fn, "train"), params, bufs)]

    [r] = measure(case, "checkpoint", make, reps=1)
    assert r.allclose is True and r.buffers_close is False


def test_compile_aot_eager_is_allclose():
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    saved = fconfig.activation_memory_budget, iconfig.fallback_random
    try:
        case = zoo.build("mlp", "tiny")
        [r] = measure(case, "compile", S.compiled(0.5, backend="aot_eager"), reps=1)
    finally:
        fconfig.activation_memory_budget, iconfig.fallback_random = saved
        torch._dynamo.reset()
    assert r.error is None and r.allclose is True and r.tracker_peak is None
    assert r.setting == "budget=0.5" and r.note == "backend=aot_eager"
    assert 0 < r.extra["saved_bytes"] < r.peak


def test_pareto_and_dominance():
    pts = [(10, 1.0), (5, 1.2), (7, 1.1), (8, 1.3), (3, 2.0)]
    assert pareto(pts) == [(3, 2.0), (5, 1.2), (7, 1.1), (10, 1.0)]
    front = pareto(pts)
    assert dominated((5, 1.2), front)             # a front point covers itself
    assert dominated((8, 1.3), front)             # (7, 1.1) is better in both
    assert dominated((5.08, 1.19), front)         # (5, 1.2) is within 2% in time
    assert dominated((4.95, 1.2), front)          # 1% lower peak: within the 2% tolerance
    assert not dominated((4.8, 1.2), front)       # 4% lower peak than any at that time
    assert not dominated((11, 0.9), front)        # faster than all of them
    assert not dominated((11, 0.9), [])


def test_check_counts_peer_points():
    rows = [Result("m", "eager", "", peak=100, time=1.0, time_ratio=1.0),
            Result("m", "checkpoint", "", peak=40, time=1.3, time_ratio=1.3),
            Result("m", "compile", "budget=0.0", peak=30, time=0.9, time_ratio=0.9),
            Result("m", "rockmate", "", error="ImportError"),
            Result("m", "magis", "plan 1/2", peak=35, time=1.05, time_ratio=1.05),
            Result("m", "magis", "plan 2/2", peak=95, time=0.95, time_ratio=0.95)]
    add_ratios(rows)
    acc = peers.check(rows, 0.02)["m"]
    assert acc["peer_points"] == 3 and acc["dominated_points"] == 2
    assert acc["not_dominated"] == ["compile budget=0.0"] and acc["dominates"] is False
    assert acc["best_peak_ratio_within_10pct"] == 0.35


def test_spread_keeps_both_ends_and_spaces_the_peaks():
    ident = lambda p: p  # noqa: E731
    assert S.spread(list(range(10)), 4, key=ident) == [0, 3, 6, 9]
    assert S.spread([1, 2], 6, key=ident) == [1, 2]
    # U-Net's front in the last peers run (simulated peak ratios): by index, the
    # spread measured both 0.281 plans and skipped 0.893 (remat 4)
    front = [0.281, 0.281, 0.507, 0.657, 0.786, 0.893, 1.0, 1.005]
    assert S.spread(front, 6, key=ident) == [0.281, 0.507, 0.657, 0.786, 0.893, 1.005]
    # evenly spaced peaks, not indices: a cluster at the low end gets one point
    assert S.spread([0.1, 0.11, 0.12, 0.13, 0.5, 1.0], 3, key=ident) == [0.1, 0.5, 1.0]


@pytest.fixture(scope="module")
def swapping_plan():
    """gpt tiny (dropout 0.1) and its lowest-peak plan under a 30% budget without
    fission: swaps only (with fission the search splits the whole step, which
    is not what these tests compile). ``swap=True``: on the CPU swapping is off
    by default (Note [which memory])."""
    from magis_nb.search import optimize

    case = zoo.build("gpt", "tiny")
    res = optimize(case.model, case.inputs, loss_fn=case.loss_fn, mem_budget=0.3, max_states=40,
                   time_budget=60, fission=False, swap=True)
    plan = min(res.pareto, key=lambda p: p.peak)
    return case, res, plan


def _step_of(case, mod):
    params = list(case.model.parameters())
    return Candidate("", lambda: mod.step(*case.inputs), params, list(case.model.buffers()), trackable=False)


def test_make_opaque_rewrites_every_swap_and_draw(swapping_plan):
    # aot_eager: the rewrite and its numerics without inductor's C++ compile
    from magis_nb.bench.peers_compile import compile_plan

    case, res, plan = swapping_plan
    log = {}
    mod = compile_plan(res.builder.module(plan), "aot_eager", log=log)
    [r] = measure(case, "magis+aot_eager", lambda c: [_step_of(c, mod)], reps=1)
    torch._dynamo.reset()
    assert r.error is None and r.allclose is True, r
    n = len(mod.host_buffers)
    assert n > 0 and log["pools"] == log["stores"] == n and log["loads"] >= n
    assert log["draws"] == 13  # gpt tiny: 4 layers x 3 dropouts + the embeddings' one


@pytest.mark.slow
def test_magis_plus_inductor_keeps_the_plan_and_eager_numerics(swapping_plan):
    # Note [compiling a plan]: without the opaque Store/Load, inductor keeps every
    # swapped tensor allocated (peak 4x the plan's), and fuses a dropout mask's
    # reader ahead of its bernoulli_ (loss off by 1e-3)
    import torch._inductor.config as iconfig

    from magis_nb.bench.peers_compile import compile_plan

    case, res, plan = swapping_plan
    ref = Reference.of(case)
    plain = res.builder.module(plan)
    mod = compile_plan(res.builder.module(plan), "inductor")
    saved = iconfig.fallback_random
    iconfig.fallback_random = True
    try:
        rows = measure(case, "magis", lambda c: [_step_of(c, plain)], reps=1, ref=ref)
        rows += measure(case, "magis+inductor", lambda c: [_step_of(c, mod)], reps=1, ref=ref)
    finally:
        iconfig.fallback_random = saved
        torch._dynamo.reset()
    plain_r, comp = rows
    assert comp.error is None and comp.allclose is True and comp.max_err < 1e-5, comp
    assert plain_r.peak < 0.5 * ref_peak(case), (plain_r.peak, ref_peak(case))
    # The bound is there to catch the 4x of a plan compiled without the opaque
    # Store/Load (Note [compiling a plan]), not to price inductor's own planning.
    # Measured on this fixture (2026-12-07, 2-core CPU, swap 64; algebra 4): the
    # plan peaks 55.09 MB as ATen, 63.85 MB compiled (x1.159; x1.17 in the run
    # that set 1.20, so the bound leaves ~3%). Of the 8.75 MB, 3.16 MB is
    # inductor's reorder_for_locality (off: 60.68 MB, x1.101); the rest is not
    # its peak-memory reordering (toggled: 63.75 MB) nor fusion alone
    # (max_fusion_size=1: 63.85 MB; with locality off too: 65.17 MB) and was not
    # attributed further; the earlier reading (the tied embedding's two
    # gradients summed inside the program) was not measured. The re-order-only
    # program compiles 8% under its ATen peak (238.4 vs 259.9 MB): the excess
    # is specific to the swapping plan.
    assert comp.peak <= 1.20 * plain_r.peak, (comp.peak, plain_r.peak)


def ref_peak(case) -> int:
    [r] = measure(case, "eager", S.eager, reps=1)
    return r.peak


def test_strategies_name_magis_plus_inductor():
    runs = S.strategies(backend="aot_eager")
    assert [k for k, _ in runs["magis+inductor"]] == [""]
    assert "magis+inductor" in peers.PEERS and set(peers.OURS) == {"magis", "magis+inductor"}


def test_check_counts_both_magis_strategies_as_the_front():
    rows = [Result("m", "eager", "", peak=100, time=1.0, time_ratio=1.0),
            Result("m", "compile", "budget=1.0", peak=80, time=0.7, time_ratio=0.7),
            Result("m", "magis", "plan 1/1", peak=30, time=1.0, time_ratio=1.0),
            Result("m", "magis+inductor", "plan 1/1", peak=79, time=0.69, time_ratio=0.69)]
    add_ratios(rows)
    acc = peers.check(rows, 0.02)["m"]
    assert acc["peer_points"] == 2 and acc["dominates"] is True
    acc = peers.check(rows[:3], 0.02)["m"]
    assert acc["not_dominated"] == ["compile budget=1.0"]
    assert acc["best_peak_ratio_within_10pct"] == 0.3


def test_share_conv_inputs_reads_each_weight_and_cat_through_one_clone():
    from torch.fx.experimental.proxy_tensor import make_fx

    from magis_nb.bench.peers_compile import share_conv_inputs

    aten = torch.ops.aten

    def f(a, b, w, g):
        c = aten.cat.default([torch.relu(a), b], 1)
        y = aten.convolution.default(c, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        gi, gw, _ = aten.convolution_backward.default(g * y, c, w, [0], [1, 1], [1, 1], [1, 1], False,
                                                      [0, 0], 1, [True, True, False])
        return y, gi, gw

    args = (torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8), torch.randn(4, 6, 3, 3), torch.randn(2, 4, 8, 8))
    gm = make_fx(f)(*args)
    want = gm(*args)
    assert share_conv_inputs(gm) == 2  # the weight and the cat; ``g`` is read once
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert all(n.kwargs["memory_format"] is torch.channels_last and len(n.users) == 2 for n in clones)
    for got, ref in zip(gm(*args), want):
        torch.testing.assert_close(got, ref)


@pytest.mark.slow
def test_magis_plus_inductor_converts_a_unet_skip_once():
    # a U-Net's cat is read by its convolution and by that convolution's backward;
    # inductor copied it once per reader and made the backward's copy in the forward
    # (bench-size U-Net: compiled peak 1.12x eager's). Through one clone it is not.
    from magis_nb.bench.peers_compile import compile_plan
    from magis_nb.search import optimize

    case = zoo.build("unet", "tiny")
    res = optimize(case.model, case.inputs, loss_fn=case.loss_fn, lat_budget=1.10, max_states=1,
                   time_budget=30)
    ref = Reference.of(case)
    log = {}
    plain = res.builder.module(res.before)
    mod = compile_plan(res.builder.module(res.before), "inductor", log=log)
    try:
        rows = measure(case, "magis", lambda c: [_step_of(c, plain)], reps=1, ref=ref)
        rows += measure(case, "magis+inductor", lambda c: [_step_of(c, mod)], reps=1, ref=ref)
    finally:
        torch._dynamo.reset()
    plain_r, comp = rows
    assert comp.error is None and comp.allclose is True, comp
    assert comp.peak <= 1.02 * plain_r.peak, (comp.peak, plain_r.peak)
    assert log["conv_inputs_shared"] > 0, log


def test_check_without_an_eager_row_has_no_peak_ratios_and_does_not_fail():
    # `bench peers --strategies magis+inductor` alone: no eager row, so no peak ratio
    rows = [Result("m", "magis+inductor", "plan 1/2", peak=30, time=1.0, time_ratio=0.9),
            Result("m", "magis+inductor", "plan 2/2", peak=50, time=0.8, time_ratio=0.8)]
    add_ratios(rows)
    acc = peers.check(rows, 0.02)["m"]
    assert acc["best_peak_ratio_within_10pct"] is None and acc["peer_points"] == 0


def test_magis_candidates_build_their_module_at_the_first_step_and_release_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    case = zoo.ZooCase("mlp3", "tiny", model, (torch.randn(32, 16), torch.randint(0, 4, (32,))),
                       nn.functional.cross_entropy, torch.float32, "")
    cands = S.magis(3.0, 2)(case)
    assert cands and all(c.release is not None for c in cands)
    res = cands[0].step.__closure__          # the OptimizeResult the candidates share
    result = next(x.cell_contents for x in res if hasattr(x.cell_contents, "module_for"))
    assert result.built == 0             # nothing built before a candidate runs
    released = []
    for c in cands:
        c.release = (lambda r=c.release, s=c.setting: (r(), released.append(s)))
    rows = measure(case, "magis", lambda _: cands, reps=1)
    assert [r.setting for r in rows] == released and all(r.allclose for r in rows)
    assert result.built == 0             # each module dropped once measured
    for c in cands:                          # host bytes read off the plan match its module's
        plan = next(p for p in result.pareto if p.applied == c.note and p.peak == c.extra["sim_peak"])
        pools = result.module_for(plan).host_buffers
        assert c.extra["host_bytes"] == sum(t.numel() * t.element_size() for t in pools)
        result.drop_module(plan)
    assert result.built == 0


def test_gpu_stand_in_plans_are_kept_apart_from_the_comparison():
    """magis-gpu's peak is a GPU's memory on a stand-in (its swapped bytes live in
    host buffers): neither a peer point to beat nor a point of magis_nb's front."""
    rows = [Result("m", "eager", "", peak=100, time=1.0, time_ratio=1.0),
            Result("m", "magis", "plan 1/1", peak=60, time=1.0, time_ratio=1.0),
            Result("m", "magis-gpu", "plan 1/1", peak=10, time=0.5, time_ratio=0.5)]
    add_ratios(rows)
    acc = peers.check(rows, 0.02)["m"]
    assert acc["peer_points"] == 1 and acc["dominates"] is True
    assert acc["best_peak_ratio_within_10pct"] == 0.6
    assert "(device)" in peers._show(rows[2])["peak_MiB"] and "(device)" not in peers._show(rows[1])["peak_MiB"]


@pytest.mark.parametrize("strategy, swap", [("magis", False), ("magis+inductor", False),
                                            ("magis-gpu", True)])
def test_cpu_plans_do_not_swap(strategy, swap, monkeypatch):
    import magis_nb.search as search

    seen = {}

    class Stop(Exception):
        pass

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(search, "optimize", fake)
    (_, make), = S.strategies(backend="aot_eager")[strategy]
    case = type("Case", (), {"model": None, "inputs": (), "loss_fn": None})()
    with pytest.raises(Stop):
        make(case)
    assert seen["swap"] is swap
