"""Simulator against hand-computed peaks (1 MiB tensors) and the measured peak."""
import torch
import torch.nn as nn

from magis_nb.program import trace
from magis_nb.runtime import measure_cpu
from magis_nb.simulate import MemGraph, Storage, simulate_memory

MiB = 2**20
N = MiB // 4  # float32 elements in 1 MiB


def test_chain_with_resident_weight():
    g = MemGraph(3, [[], [0], [1]], [
        Storage(MiB, -1, (0,), category="weight"),
        Storage(MiB, 0, (1,)),
        Storage(MiB, 1, (2,)),
        Storage(MiB, 2, (), keep=True),
    ])
    tl = simulate_memory(g, [0, 1, 2])
    assert tl.live == [2 * MiB, 3 * MiB, 3 * MiB]
    assert tl.peak == 3 * MiB and tl.peak_steps == [1, 2]
    assert tl.hotspots == [0, 1, 2, 3]
    assert tl.by_category["weight"] == [MiB] * 3


def test_unused_output_lives_only_during_its_op():
    g = MemGraph(2, [[], [0]], [Storage(2 * MiB, 0, ()), Storage(MiB, 0, (1,)),
                                Storage(MiB, 1, (), keep=True)])
    assert simulate_memory(g, [0, 1]).live == [3 * MiB, 2 * MiB]


def test_rejects_non_topological_order():
    g = MemGraph(2, [[], [0]], [Storage(MiB, 0, (1,)), Storage(MiB, 1, ())])
    try:
        simulate_memory(g, [1, 0])
    except ValueError:
        return
    raise AssertionError("expected ValueError")


def _sim_and_measure(model, x):
    prog = trace(model, (x,), mode="infer")
    sim = prog.simulate()
    mod = prog.module()
    meas = measure_cpu(lambda: mod(x), [x])
    return sim, meas, prog


class Views(nn.Module):
    def forward(self, x):
        a = x * 2                    # 1 MiB
        c = a.view(512, 512).t()     # views of a: nothing allocated, a stays alive
        return c + 1                 # 1 MiB, while x, a (through c) are live


def test_views_allocate_nothing_and_keep_base_alive():
    sim, meas, prog = _sim_and_measure(Views(), torch.randn(N))
    assert sim.peak == 3 * MiB
    assert meas.peak == 3 * MiB
    views = [n for n in prog.graph.ops if n.outputs[0].alias is not None]
    assert {n.target for n in views} >= {"aten.view.default", "aten.t.default"}
    assert all(n.outputs[0].nbytes == 0 for n in views)


class MultiOut(nn.Module):
    def forward(self, x):
        values, indices = torch.sort(x)   # 1 MiB float32 + 2 MiB int64
        return values * 2                 # indices are dropped at once


def test_multi_output_op_unused_output_freed():
    sim, meas, _ = _sim_and_measure(MultiOut(), torch.randn(N))
    assert sim.live[0] == 4 * MiB      # x, values, indices
    assert sim.peak == 4 * MiB and meas.peak == 4 * MiB
    assert sim.live[-1] == 3 * MiB     # x, values, out


class KeptOutputs(nn.Module):
    def forward(self, x):
        a = x * 2
        t = x + 1
        return a, t * 3


def test_outputs_stay_live():
    sim, meas, _ = _sim_and_measure(KeptOutputs(), torch.randn(N))
    assert sim.live == [2 * MiB, 3 * MiB, 4 * MiB]
    assert meas.peak == 4 * MiB


def test_op_floor_is_resident_plus_the_largest_working_set():
    """Weight 1 MiB; op 1 reads a (2 MiB) and writes b (3 MiB): 1 + 5 = 6 MiB,
    whatever the order; every order's peak is at least that."""
    from magis_nb.simulate.memory import op_floor
    g = MemGraph(3, [[], [0], [1]], [
        Storage(MiB, -1, (0, 2), category="weight"),
        Storage(2 * MiB, 0, (1,)),
        Storage(3 * MiB, 1, (2,)),
        Storage(MiB, 2, (), keep=True),
    ])
    assert op_floor(g) == 6 * MiB
    assert simulate_memory(g, [0, 1, 2]).peak >= op_floor(g)


def test_fold_keeps_its_columns_storage():
    """``F.fold`` (col2im) resizes an output made ``empty_like`` its columns: its
    storage is the columns' size where windows overlap, and the simulator counts
    that (a split plan of this model measured 34 KB over its simulated peak)."""
    import torch.nn as nn
    import torch.nn.functional as F

    import magis_nb
    from magis_nb.program import trace
    from magis_nb.verify import Reference

    class Fold(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3 * 16, 3 * 16)

        def forward(self, x):
            p = F.unfold(x, 4, stride=2, padding=1)
            return F.fold(self.lin(p.transpose(1, 2)).transpose(1, 2), x.shape[-2:], 4,
                          stride=2, padding=1)

    torch.manual_seed(0)
    model = Fold()
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    cols = F.unfold(x, 4, stride=2, padding=1)
    assert F.fold(cols, (16, 16), 4, stride=2, padding=1).untyped_storage().nbytes() == cols.nbytes
    g = trace(model, (x, y), loss_fn=F.mse_loss).graph
    assert [n.outputs[0].nbytes for n in g.ops if n.target == "aten.col2im.default"] == [cols.nbytes]
    res = magis_nb.optimize(model, (x, y), loss_fn=F.mse_loss, mem_budget=0.6, max_states=25)
    ref = Reference(model, (x, y), F.mse_loss, "train")
    for plan in res.pareto:
        chk = ref.check(res.module_for(plan))
        assert chk.comparison.allclose and chk.measured_peak == plan.peak, plan


def test_an_input_that_views_a_larger_storage_counts_the_storage():
    """``torch.hann_window(64)`` keeps 64 of the 65 points it computed: the buffer's
    storage is 260 bytes, and the simulator counts what the process holds."""
    import torch.nn.functional as F

    from magis_nb.runtime import OptimizedModule
    from magis_nb.verify import Reference

    class Win(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("win", torch.hann_window(64))
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return self.lin(x * self.win)

    model = Win()
    assert model.win.untyped_storage().nbytes() == 65 * 4
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    prog = trace(model, (x, y), loss_fn=F.mse_loss)
    order = prog.to_node_order(prog.program_order())
    chk = Reference(model, (x, y), F.mse_loss, "train").check(
        OptimizedModule(model, prog.captured, prog.graph, order))
    assert chk.comparison.allclose and chk.measured_peak == prog.simulate().peak
    # a batch sliced out of a larger tensor (a dataset held in memory) likewise
    data = torch.randn(100, 64)
    x = data[10:14]
    prog = trace(model, (x, y), loss_fn=F.mse_loss)
    order = prog.to_node_order(prog.program_order())
    chk = Reference(model, (x, y), F.mse_loss, "train").check(
        OptimizedModule(model, prog.captured, prog.graph, order))
    assert chk.comparison.allclose and chk.measured_peak == prog.simulate().peak
