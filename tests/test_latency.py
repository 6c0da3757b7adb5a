"""The latency simulator: a compute stream and a copy stream joined by events, exact times."""
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from magis_nb.ir.graph import Graph, Node, Ref, TensorInfo
from magis_nb.program import trace
from magis_nb.simulate.cost import RooflineCost, op_costs
from magis_nb.simulate.latency import LatencyResult, Transfer, program_latency, simulate_latency

GB = 10**9


class Unit:
    """Every op 1 s; the host link moves 1 GB/s."""

    def op_cost(self, graph, node):
        return 1.0

    def transfer_cost(self, nbytes):
        return nbytes / GB


def chain(n: int = 4) -> Graph:
    """input -> op1 -> op2 -> ... (relu chain); op node ids are 1..n."""
    t = TensorInfo((4,), torch.float32, 16)
    nodes = [Node(0, "x", "input", "input", outputs=[t])]
    for i in range(1, n + 1):
        nodes.append(Node(i, f"r{i}", "op", "aten.relu.default", torch.ops.aten.relu.default,
                          (Ref(i - 1),), outputs=[t]))
    return Graph(nodes, [Ref(n)], [("out",)])


G = chain()
ORDER = [1, 2, 3, 4]


def test_compute_only():
    r = simulate_latency(G, ORDER, Unit())
    assert isinstance(r, LatencyResult)
    assert (r.total_s, r.compute_s, r.copy_s, r.stall_s) == (4.0, 4.0, 0.0, 0.0)
    assert r.op_times == {1: (0, 1), 2: (1, 2), 3: (2, 3), 4: (3, 4)}


def test_hidden_load():
    """A 0.5 s load issued after op1 (t=1) is done at 1.5, before op3 starts at 2."""
    r = simulate_latency(G, ORDER, Unit(), transfers=[("load", GB // 2, 1, 3)])
    assert r.total_s == 4.0 and r.copy_s == 0.5 and r.stall_s == 0.0
    assert r.transfer_times == [(1.0, 1.5)]
    assert r.op_times[3] == (2.0, 3.0)


def test_exposed_load():
    """Issued after op2 (t=2) for op3: op3 waits until 2.5; everything after shifts."""
    r = simulate_latency(G, ORDER, Unit(), transfers=[Transfer("load", GB // 2, 2, 3)])
    assert r.total_s == 4.5 and r.stall_s == 0.5
    assert r.op_times[3] == (2.5, 3.5) and r.op_times[4] == (3.5, 4.5)


def test_load_at_start_and_trailing_store():
    r = simulate_latency(G, ORDER, Unit(), transfers=[("load", GB // 2, None, 1)])
    assert r.op_times[1] == (0.5, 1.5) and r.total_s == 4.5
    # a store after the last op: the step ends when the copy stream is done
    r = simulate_latency(G, ORDER, Unit(), transfers=[("store", GB // 2, 4, None)])
    assert r.op_times[4] == (3.0, 4.0) and r.transfer_times == [(4.0, 4.5)]
    assert r.total_s == 4.5 and r.compute_s == 4.0


def test_copies_are_serialized_in_the_given_order():
    """Store and loads after op1 share the copy stream: 1-1.5, 1.5-2, 2-2.5."""
    xs = [("store", GB // 2, 1, None), ("load", GB // 2, 1, 3), ("load", GB // 2, 1, 4)]
    r = simulate_latency(G, ORDER, Unit(), transfers=xs)
    assert r.transfer_times == [(1.0, 1.5), (1.5, 2.0), (2.0, 2.5)]
    assert r.op_times[3] == (2.0, 3.0) and r.total_s == 4.0
    # two loads before op3 (ends 2.0 and 2.5): op3 waits for the later one
    xs = [("store", GB // 2, 1, None), ("load", GB // 2, 1, 3), ("load", GB // 2, 1, 3)]
    r = simulate_latency(G, ORDER, Unit(), transfers=xs)
    assert r.op_times[3] == (2.5, 3.5) and r.total_s == 4.5
    # a transfer waits for its event even when the copy stream is idle
    r = simulate_latency(G, ORDER, Unit(), transfers=[("store", GB, 3, None), ("load", GB // 2, 1, 4)])
    assert r.transfer_times == [(3.0, 4.0), (4.0, 4.5)]
    assert r.op_times[4] == (4.5, 5.5)


def test_invalid_inputs():
    with pytest.raises(ValueError, match="deadlock"):
        simulate_latency(G, ORDER, Unit(), transfers=[("load", 1, 3, 2)])
    with pytest.raises(ValueError, match="deadlock"):      # FIFO copy stream blocks the second
        simulate_latency(G, ORDER, Unit(), transfers=[("store", 1, 4, None), ("load", 1, 1, 2)])
    with pytest.raises(ValueError, match="kind"):
        simulate_latency(G, ORDER, Unit(), transfers=[("swap", 1, 1, 2)])
    with pytest.raises(ValueError, match="not in the order"):
        simulate_latency(G, [1, 2], Unit(), transfers=[("load", 1, 1, 3)])
    with pytest.raises(ValueError, match="predecessor"):
        simulate_latency(G, [2, 1, 3, 4], Unit())
    with pytest.raises(ValueError, match="not an op"):
        simulate_latency(G, [0, 1], Unit())
    with pytest.raises(ValueError, match="CostModel"):
        simulate_latency(G, ORDER, {1: 1, 2: 1, 3: 1, 4: 1}, transfers=[("load", 1, 1, 2)])


def test_cost_table():
    r = simulate_latency(G, ORDER, {1: 0.25, 2: 0.5, 3: 1.0, 4: 2.0})
    assert r.total_s == 3.75 and r.op_times[4] == (1.75, 3.75)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["store", "load"]), st.integers(0, 3 * GB),
                          st.integers(1, 4), st.integers(0, 4)), max_size=5))
def test_stream_invariants(raw):
    """Whenever it is not a deadlock: the streams never overlap themselves, every
    event is honoured, and total lies between the busier stream and their sum."""
    # issued in the order of their events, each waited for (if at all) by a later op:
    # never a deadlock
    xs = sorted(((kind, nb, a, (a + k if a + k <= 4 else None) if k else None)
                 for kind, nb, a, k in raw), key=lambda x: x[2])
    r = simulate_latency(G, ORDER, Unit(), transfers=xs)
    ends = [r.op_times[v] for v in ORDER]
    assert all(e0[1] <= e1[0] for e0, e1 in zip(ends, ends[1:]))
    assert all(t0[1] <= t1[0] for t0, t1 in zip(r.transfer_times, r.transfer_times[1:]))
    for (kind, nb, a, b), (s, e) in zip(xs, r.transfer_times):
        assert s >= r.op_times[a][1] and math.isclose(e - s, nb / GB, abs_tol=1e-9)
        if b is not None:
            assert r.op_times[b][0] >= e
    assert max(r.compute_s, r.copy_s) <= r.total_s <= r.compute_s + r.copy_s + 1e-9


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.a(x).relu())


def test_program_latency_in_program_order():
    prog = trace(TwoLayer(), (torch.randn(4, 8), torch.randn(4, 4)), loss_fn=nn.functional.mse_loss)
    cost = RooflineCost("rtx3090")
    r = program_latency(prog, cost)
    table = op_costs(prog.graph, cost)
    assert r.order == prog.graph.program_order()
    assert r.total_s == pytest.approx(sum(table.values())) and r.total_s > 0
    assert program_latency(prog, table).total_s == pytest.approx(r.total_s)
