"""The latency floor (search/floor.py): a lower bound on every plan's peak
under a latency budget, for training steps with BatchNorm."""
import pytest

import magis_nb
from magis_nb import zoo
from magis_nb.search.floor import barrier_floor, max_flow


def test_max_flow_is_the_minimum_cut():
    # the textbook network (CLRS fig. 26.6): its maximum flow is 23
    edges = [(0, 1, 16), (0, 2, 13), (1, 3, 12), (2, 1, 4), (2, 4, 14), (3, 2, 9),
             (3, 5, 20), (4, 3, 7), (4, 5, 4)]
    assert max_flow(6, edges, 0, 5) == 23
    # an infinite edge is never the cut
    assert max_flow(3, [(0, 1, float("inf")), (1, 2, 5.0)], 0, 2) == 5.0
    assert max_flow(3, [(0, 1, 1.0)], 0, 2) == 0.0


def _search(name: str, states: int):
    case = zoo.build(name, "tiny", device="meta")
    return magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, device_profile="rtx3090",
                             lat_budget=1.10, time_budget=120, max_states=states, verify=False)


@pytest.mark.parametrize("name", ["resnet", "unetpp"])
def test_no_plan_the_search_finds_is_below_the_floor(name):
    res = _search(name, 40)
    g, order = res.before.state.runs
    costs = res.builder.space.costs
    before = res.before
    floors = [barrier_floor(g, order, costs, b) for b in (1.0, 1.05, 1.10, 1.5)]
    # higher budgets allow more recompute and copies: never a higher floor
    assert all(a.bytes >= b.bytes for a, b in zip(floors, floors[1:]))
    resident = sum(t.nbytes for n in g.inputs if n.category != "host"
                   for t in n.outputs if t is not None and t.alias is None)
    assert floors[-1].bytes >= resident
    # the eager program sits at its own latency; the floor there is not trivial
    assert resident < floors[0].bytes <= before.peak
    # no time to recompute at lat 1.0 (but cats, which their splits remove)
    assert floors[0].kept <= floors[0].needed and floors[-1].kept <= floors[0].kept
    if name == "resnet":
        assert floors[0].kept == floors[0].needed
    assert len(res.pareto) > 3
    for p in res.pareto:
        f = barrier_floor(g, order, costs, p.latency / before.latency)
        assert f.bytes <= p.peak, (p.applied, f, p.peak)


def test_no_floor_without_a_training_batch_norm_or_async_copies():
    res = _search("gpt", 1)
    g, order = res.before.state.runs
    assert barrier_floor(g, order, res.builder.space.costs, 1.1) is None
    case = zoo.build("resnet", "tiny")
    res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, lat_budget=1.1,
                            device_profile="cpu", time_budget=60, max_states=1, verify=False)
    # the CPU copies itself: a swap costs compute time, not modeled by the floor
    g, order = res.before.state.runs
    assert barrier_floor(g, order, res.builder.space.costs, 1.1) is None
