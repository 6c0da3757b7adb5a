"""Swapping on the CPU, and which memory a result's numbers are (Note [which
memory] in `search.report`): a CPU plan does not swap by default and reports the
process's memory, measured; a plan for a GPU profile says it ran on a stand-in."""
import pytest

import magis_nb
from magis_nb import zoo
from magis_nb.search.proposals import proposals
from magis_nb.search.report import memory_kind, result_html


@pytest.fixture(scope="module")
def mlp():
    return zoo.build("mlp", "tiny")


def _rules(res) -> set[str]:
    """The rules the search's root state proposes."""
    sp = res.builder.space
    return {rule for rule, *_ in proposals(sp, sp.evaluate((), (), sp.base))}


def _run(case, **kw):
    return magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, mem_budget=0.4,
                             time_budget=60, max_states=16, **kw)


def test_cpu_plans_do_not_swap_by_default_and_report_process_memory(mlp):
    res = _run(mlp)                         # measured on this CPU, no profile named
    assert res.swap is False and res.device == "cpu"
    assert all(not p.swaps for p in res.pareto)
    assert "remat" in _rules(res) and not any(r.startswith("swap") for r in _rules(res))
    assert "process memory" in memory_kind(res) and "no swaps" in memory_kind(res)
    m = res.measured                        # the safety net ran the chosen plan
    assert m is not None and m.host_bytes == 0 and m.process_peak == m.peak
    # the tracker counts what the step allocates; the plan's is its simulated peak
    assert abs(m.peak - res.plan.peak) <= 0.01 * res.plan.peak
    table = res.table()
    assert "measured process memory of one step" in table and "eager PyTorch" in table


def test_a_gpu_profile_swaps_and_says_it_ran_on_a_stand_in(mlp):
    # without fission: with it the tiny MLP's plan is a split and swaps nothing
    # (fission x0[0]/8 at 0.4), and the swap's report is what this test is about
    res = _run(mlp, device_profile="rtx3090", fission=False)
    assert res.swap is True
    assert "swap" in _rules(res)
    assert memory_kind(res) == ("planned for RTX 3090; device memory measured here as a "
                                "stand-in, swapped bytes live in host memory")
    assert "planned for RTX 3090" in result_html(res)
    assert res.plan.swaps                   # remat 1; swap 1 when written
    assert res.measured.host_bytes > 0
    assert "host buffers" in res.table()


def test_swap_true_allows_swaps_on_the_cpu_and_the_report_warns(mlp):
    res = _run(mlp, swap=True, verify=False)
    assert res.swap is True and res.measured is None
    assert "swap" in _rules(res)
    assert "saves less" in memory_kind(res)
    off = _run(mlp, device_profile="rtx3090", swap=False, verify=False)
    assert all(not p.swaps for p in off.pareto)


def test_a_new_profile_names_itself_in_the_report(monkeypatch):
    """A device profile says its name and that it is a GPU: adding one to
    `PROFILES` is all a report needs (no second table to forget)."""
    from types import SimpleNamespace

    from magis_nb.simulate.profiles import PROFILES, DeviceProfile
    monkeypatch.setitem(PROFILES, "l40s", DeviceProfile(
        "l40s", {"float32": 91.6e12}, mem_bw=864e9, host_link_bw=25e9,
        launch_overhead_s=5e-6, display="L40S"))
    res = SimpleNamespace(profile="roofline:l40s", device="cpu", swap=True)
    assert memory_kind(res).startswith("planned for L40S; device memory measured here")
    cpu = SimpleNamespace(profile="roofline:cpu", device="cpu", swap=False)
    assert "process memory" in memory_kind(cpu)
