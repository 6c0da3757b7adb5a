"""The search loop's housekeeping: a new best expanded before its siblings, and
the garbage collector paused while planning."""
import gc
import weakref

import torch

from magis_nb import zoo
from magis_nb.program import trace
from magis_nb.search import algorithm, gcpause
from magis_nb.search.objective import Objective
from magis_nb.search.space import Space, State
from magis_nb.simulate.cost import make_cost


def test_a_new_best_is_expanded_before_its_siblings(monkeypatch):
    """When a child becomes the best plan, the rest of its parent's chunk goes
    back to the front of the parent's list: the child's own children come
    first, then the parent's remaining ones in their order."""
    torch.manual_seed(0)
    case = zoo.build("gpt", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    space = Space(prog, make_cost("rtx3090"), async_copies=True)
    root = space.evaluate((), (), prog.graph)
    s = algorithm.Search(space, root, Objective("lat", 3.0 * root.latency), 60.0, 0,
                          None, None, 1.0)
    monkeypatch.setattr(algorithm, "enable_top", lambda *a: None)
    monkeypatch.setattr(algorithm, "proposals",
                        lambda *a, **k: [(f"r{i}", (), (), set()) for i in range(5)])
    seen = []

    def visit(st, rule, plan, batches, touched):
        seen.append(("root" if st is root else "child", rule))
        if st is root and rule == "r1":
            child = State((), (), root.graph, [], root.order, root.peak // 2, root.latency, [], 0)
            s.record(child)
            return child
        return None

    s.visit = visit
    s.run(root)
    assert seen == [("root", "r0"), ("root", "r1")] \
        + [("child", f"r{i}") for i in range(5)] + [("root", f"r{i}") for i in (2, 3, 4)]


def test_planning_pauses_the_collector_and_collects_when_due(monkeypatch):
    """Inside `paused_gc` nothing collects on its own (a reference cycle stays);
    `collect_due` collects once EVERY objects were allocated; the collector is
    as it was afterwards, on or off."""

    class Cycle:
        pass

    assert gc.isenabled()
    with gcpause.paused_gc():
        assert not gc.isenabled()
        c = Cycle()
        c.me = c
        dead = weakref.ref(c)
        del c
        junk = [[] for _ in range(5000)]      # past the automatic threshold (700)
        del junk
        assert dead() is not None
        monkeypatch.setattr(gcpause, "EVERY", 10 ** 9)
        gcpause.collect_due()
        assert dead() is not None
        monkeypatch.setattr(gcpause, "EVERY", 1)
        gcpause.collect_due()
        assert dead() is None
    assert gc.isenabled()
    gc.disable()
    try:
        with gcpause.paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
