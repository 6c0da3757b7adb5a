"""Gradient buckets in the program (distributed/buckets.py), one process: the
bucketed program equals eager, its measured peak equals the simulated one, and
the latency model's comm stream overlaps what it should."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from magis_nb import zoo
from magis_nb.distributed import CommLink, add_buckets, group_buckets
from magis_nb.ir.graph import Region
from magis_nb.program import trace
from magis_nb.runtime import OptimizedModule
from magis_nb.runtime.measure import measure_cpu, model_baseline
from magis_nb.simulate.latency import simulate_latency
from magis_nb.simulate.memory import simulate_memory
from magis_nb.verify import Reference


def _sim_peak(g, order):
    mg, ids, _ = g.memgraph()
    index = {v: i for i, v in enumerate(ids)}
    return simulate_memory(mg, [index[v] for v in order]).peak


@pytest.mark.parametrize("name,cap", [("mlp", 1 << 12), ("gpt", 1 << 16), ("resnet", 1 << 17)])
def test_bucketed_program_equals_eager_and_its_simulated_peak(name, cap):
    case = zoo.build(name, "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    order = prog.graph.program_order()
    g, o, buckets = add_buckets(prog.graph, order, cap)
    n_grads = sum(1 for r in prog.graph.output_roles if r[0] == "grad")
    assert sum(len(b.outputs) for b in buckets) == n_grads and len(buckets) > 1
    mod = OptimizedModule(case.model, prog.captured, g, o)
    assert mod.code.count("_comm.bucket(") == len(buckets)
    chk = Reference(case.model, case.inputs, case.loss_fn, "train").check(mod)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == _sim_peak(g, o)


def test_buckets_follow_the_order_the_backward_finishes_gradients():
    case = zoo.build("gpt", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    order = prog.graph.program_order()
    pos = {v: i for i, v in enumerate(order)}
    groups = group_buckets(prog.graph, order, 1 << 16)
    issued = [p for p, _ in groups]
    assert issued == sorted(issued)
    for p, members in groups:       # issued right after its last gradient is final
        assert max(pos[prog.graph.outputs[m].node] for m in members) == p
        sizes = [prog.graph.tensor(prog.graph.outputs[m]).nbytes for m in members]
        assert sum(sizes) <= 1 << 16 or len(members) == 1


def test_a_gradient_finished_in_a_fission_loop_is_bucketed_after_the_loop():
    from magis_nb.analysis import DGraph, apply_fission, build_ftree

    case = zoo.build("mlp", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    dg = DGraph(prog.graph)
    cands = build_ftree(dg, prog.hotspots())
    c = max(cands, key=lambda c: len(c.ops))
    split = prog.with_graph(apply_fission(dg, [c.ftrans(2)]))
    g0 = split.graph
    order = split.to_node_order(split.program_order())
    g, o, buckets = add_buckets(g0, order, 1 << 30)
    pos = {v: i for i, v in enumerate(o)}
    last_region = max((i for i, v in enumerate(o) if isinstance(g.nodes[v].region, Region)), default=-1)
    assert last_region >= 0
    for b in buckets:
        ins = [g0.outputs[m] for m in b.outputs]
        if any(isinstance(g0.nodes[r.node].region, Region) for r in ins):
            assert pos[b.node] > last_region
    mod = OptimizedModule(case.model, split.captured, g, o)
    chk = Reference(case.model, case.inputs, case.loss_fn, "train").check(mod)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == _sim_peak(g, o)


def test_comm_stream_overlaps_compute_and_ends_the_step():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    prog = trace(m, (x, y), loss_fn=F.cross_entropy)
    g, o, buckets = add_buckets(prog.graph, prog.graph.program_order(), 1)   # one per gradient
    cost = {v: 1.0 for v in o}
    link = CommLink(bandwidth=1.0, latency=0.5, world=2)    # ring: nbytes seconds + 0.5
    comms = [(b.nbytes, b.node) for b in buckets]
    lat = simulate_latency(g, o, cost, comms=comms, comm_cost=link.allreduce_cost)
    assert lat.compute_s == len(o)
    starts = [s for s, _ in lat.comm_times]
    assert starts == sorted(starts)
    for (s, e), b in zip(lat.comm_times, buckets):
        assert s >= lat.op_times[b.node][1]            # after its bucket op
        assert e - s == pytest.approx(link.allreduce_cost(b.nbytes))
    assert lat.total_s == max(lat.compute_s, lat.comm_times[-1][1])
    assert lat.comm_s == pytest.approx(sum(link.allreduce_cost(b.nbytes) for b in buckets))


def test_one_rank_link_costs_nothing():
    assert CommLink(1e9, 1e-5, world=1).allreduce_cost(1 << 20) == 0.0
    two = CommLink(1e9, 1e-5, world=2).allreduce_cost(1 << 20)
    assert two == pytest.approx(1e-5 + (1 << 20) / 1e9)


def test_measured_peak_of_the_autograd_call_with_buckets():
    case = zoo.build("mlp", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    g, o, _ = add_buckets(prog.graph, prog.graph.program_order(), 1 << 12)
    mod = OptimizedModule(case.model, prog.captured, g, o)
    base = model_baseline(case.model, case.inputs)
    peak = measure_cpu(lambda: mod(*case.inputs).backward(), base).peak
    assert peak == _sim_peak(g, o)
    assert all(p.grad is not None and p.grad.is_contiguous() for p in case.model.parameters())


def test_the_search_space_prices_buckets_and_communication():
    """`Space(comm=...)` evaluates every state with its buckets: their memory in the
    peak, their all_reduces on the latency model's third stream."""
    from magis_nb.distributed import DataParallel, nominal_link
    from magis_nb.search.space import Space
    from magis_nb.simulate.cost import make_cost

    case = zoo.build("gpt", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    plain = Space(prog, make_cost("rtx3090"), async_copies=True, fission=False)
    slow = Space(prog, make_cost("rtx3090"), async_copies=True, fission=False,
                 comm=DataParallel(None, nominal_link("ethernet", 8), cap=1 << 16))
    fast = Space(prog, make_cost("rtx3090"), async_copies=True, fission=False,
                 comm=DataParallel(None, nominal_link("nvlink", 8), cap=1 << 16))
    a, b, c = (sp.evaluate((), (), prog.graph) for sp in (plain, slow, fast))
    assert a.order == b.order == c.order                 # states keep the plain program
    g, o, buckets = slow.bucketed(b.graph, b.order)
    assert b.peak == _sim_peak(g, o) >= a.peak
    comm = sum(slow.comm.link.allreduce_cost(x.nbytes) for x in buckets)
    assert a.latency < c.latency < b.latency                 # a slower link, a slower step
    assert b.latency >= comm                                  # ethernet: communication bound
