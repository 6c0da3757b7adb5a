"""Swaps in generated code: where the copies calls go, and that the program stays
right when the copies really are asynchronous (a CPU stand-in that does every copy
as late as a copy stream may, and leaves NaN in a loaded tensor until `ready`)."""
import dataclasses
import math

import pytest
import torch

from magis_nb import zoo
from magis_nb.analysis import DGraph, apply_fission, build_ftree
from magis_nb.ir import Ref
from magis_nb.ir.graph import Graph, remap_refs
from magis_nb.program import trace
from magis_nb.rules.remat import written_in_place
from magis_nb.rules.swap import swap, swap_all, swap_ops
from magis_nb.runtime import OptimizedModule, measure_cpu
from magis_nb.runtime.copies import SYNC, copies_for
from magis_nb.simulate.memory import simulate_memory
from magis_nb.verify import Reference

from test_remat import LateUse, late_use_ids


class LateCopies:
    """Asynchronous copies at their latest legal moment, on the CPU.

    A Store's copy happens only when the program waits for it (``stored``, the
    latest a copy stream may finish it; if the program changed the tensor
    meanwhile, the buffer gets the change). A Load's destination is NaN (or -7
    for integers) until `ready`; reading it earlier shows up as a wrong result.
    """

    def __init__(self):
        self.stores, self.loads, self.readied = {}, {}, []

    def store(self, k, pool, x):
        self.stores[id(pool)] = (pool, x)

    def stored(self, k, pool):
        p, x = self.stores.pop(id(pool))
        p.copy_(x)
        return pool

    def load(self, j, pool, dev):
        if id(pool) in self.stores:
            p, x = self.stores.pop(id(pool))
            p.copy_(x)
        y = torch.empty_like(pool, device=dev)
        y.fill_(math.nan if y.is_floating_point() else -7)
        self.loads[j] = (y, pool)
        return y

    def ready(self, j):
        y, pool = self.loads.pop(j)
        y.copy_(pool)
        self.readied.append(j)

    def finish(self):
        assert not self.loads, f"loads never waited for: {sorted(self.loads)}"


def _prefetch_order(g):
    """Program order with every Load moved right after its Store: the earliest
    prefetch, so each Load is issued long before its first reader."""
    loads = set(swap_ops(g)[1])
    after = {}
    for ld in loads:
        after.setdefault(g.nodes[ld].args[0].node, []).append(ld)
    out = []
    for v in g.program_order():
        if v not in loads:
            out.append(v)
            out += after.get(v, [])
    return out


def swapped_gpt(device="cpu"):
    """Tiny GPT split by its best F-Tree candidate, with every activation outside
    the region swapped out to all its readers and the Loads prefetched as early
    as possible: (case, program, graph, order)."""
    case = zoo.build("gpt", "tiny", device=device)
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    dg = DGraph(prog.graph)
    best = max(build_ftree(dg, prog.hotspots()), key=lambda c: c.score)
    g = apply_fission(dg, [best.ftrans(2)])
    rd, written = g.readers(), written_in_place(g)
    specs = [(Ref(n.id, k), rd[Ref(n.id, k)]) for n in g.ops
             if not n.region and n.category == "activation"
             for k, t in enumerate(n.outputs)
             if t is not None and t.alias is None and Ref(n.id, k) not in written
             and rd.get(Ref(n.id, k))]
    assert len(specs) >= 8
    sg = swap_all(g, specs)
    return case, prog, sg, _prefetch_order(sg)


def simulated_peak(g, order):
    mg, op_ids, _ = g.memgraph()
    index = {v: i for i, v in enumerate(op_ids)}
    return simulate_memory(mg, [index[v] for v in order]).peak


def test_cpu_uses_synchronous_copies():
    assert copies_for("cpu", 3) is SYNC
    assert copies_for(torch.device("cpu"), 0) is SYNC


def test_store_follows_its_producer_and_ready_precedes_the_first_reader():
    x = torch.randn(1024)
    prog = trace(LateUse(), (x,), mode="infer")
    a, late = late_use_ids(prog)
    g = swap(prog.graph, Ref(a, 0), [late])
    mod = OptimizedModule(prog.model, prog.captured, g, _prefetch_order(g))
    lines = [ln.strip() for ln in mod.code.splitlines()]
    assert lines[0].endswith("*, _io=_SYNC):")
    assert lines[1].startswith("mul = aten.mul.Tensor") and lines[2] == "_io.store(0, host0_mul, mul)"
    load = next(i for i, ln in enumerate(lines) if ln.startswith("mul_load = _io.load(0, "))
    first = next(i for i, ln in enumerate(lines) if "mul_load)" in ln and "aten." in ln)
    assert load < lines.index("_io.ready(0)") == first - 1
    assert lines[-2] == "_io.finish()"
    late_io = LateCopies()
    out = mod.step_fn(x.device, x, *mod.host_buffers, _io=late_io)[0]
    torch.testing.assert_close(out, LateUse()(x))
    assert late_io.readied == [0]


def test_late_copies_train_exactly_like_eager_at_the_simulated_peak():
    """With copies done as late as a copy stream may do them (see `swapped_gpt`),
    loss and gradients equal eager's and the measured peak equals the simulated one."""
    case, prog, sg, order = swapped_gpt()
    mod = OptimizedModule(case.model, prog.captured, sg, order)
    late_io = LateCopies()
    mod.copies = late_io
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    chk = ref.check(mod)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert sorted(late_io.readied) == list(range(len(swap_ops(sg)[1])))
    assert chk.measured_peak == simulated_peak(sg, order)
    # and the default (synchronous) copies give the same step
    mod.copies = None
    chk2 = ref.check(mod)
    assert chk2.comparison.allclose and chk2.measured_peak == chk.measured_peak


def test_swapped_tensors_count_as_host_memory_on_the_cpu():
    """The host buffers exist before the step and are written in place: the CPU
    tracker does not count them, as the simulator puts them in 'host'."""
    x = torch.randn(2**18)
    prog = trace(LateUse(), (x,), mode="infer")
    a, late = late_use_ids(prog)
    sw = prog.with_graph(swap(prog.graph, Ref(a, 0), [late]))
    mod = sw.module()
    m = measure_cpu(lambda: mod(x), [x])
    assert m.peak == sw.simulate().peak == 4 * 2**20


def test_timed_sync_copies_time_every_cpu_copy_and_reset():
    from magis_nb.runtime.copies import TimedSyncCopies, copies_for

    io = copies_for("cpu", 3, timed=True)
    assert isinstance(io, TimedSyncCopies)
    x = torch.randn(256, 256)
    pool = torch.empty_like(x)
    io.store(0, pool, x)
    back = io.load(0, pool, torch.device("cpu"))
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    assert back.data_ptr() != pool.data_ptr()
    st = io.stats()
    assert st.copies == 2 and st.transfer_s > 0 and st.stall_s == st.transfer_s
    assert io.stats().copies == 0           # stats() starts a new count


def test_a_cpu_module_with_timed_copies_reports_its_transfers():
    x = torch.randn(2**16)
    prog = trace(LateUse(), (x,), mode="infer")
    a, late = late_use_ids(prog)
    mod = prog.with_graph(swap(prog.graph, Ref(a, 0), [late])).module()
    with pytest.raises(RuntimeError, match="timed_copies"):
        mod.transfer_stats()
    mod.timed_copies = True
    for _ in range(2):
        torch.testing.assert_close(mod(x), LateUse()(x))
    st = mod.transfer_stats()
    assert st.copies == 4 and st.transfer_s > 0        # a Store and a Load per step


def test_a_load_nobody_reads_is_waited_for_before_it_is_freed():
    """Freed at its own line, a Load's block would go back to the allocator while
    the copy stream still writes it: compute waits for it first."""
    x = torch.randn(1024)
    prog = trace(LateUse(), (x,), mode="infer")
    a, late = late_use_ids(prog)
    sg = swap(prog.graph, Ref(a, 0), [late])
    _, (ld,) = swap_ops(sg)
    src = sg.nodes[sg.nodes[ld].args[0].node].args[1]          # the Store's tensor
    reader, = sg.readers()[Ref(ld, 0)]
    # its reader moved back to the original (as a later rewrite may leave it)
    nodes = [dataclasses.replace(n, args=remap_refs(n.args, {Ref(ld, 0): src}))
             if n.id == reader else n for n in sg.nodes]
    g = Graph(nodes, sg.outputs, sg.output_roles)
    mod = OptimizedModule(prog.model, prog.captured, g, _prefetch_order(g))
    lines = [ln.strip() for ln in mod.code.splitlines()]
    load = next(i for i, ln in enumerate(lines) if "= _io.load(0, " in ln)
    assert lines[load + 1] == "_io.ready(0)", lines
    var = lines[load].split(" = ")[0]
    freed = next(i for i, ln in enumerate(lines) if ln.startswith("del ") and var in ln)
    assert freed > load + 1
    late_io = LateCopies()
    out = mod.step_fn(x.device, x, *mod.host_buffers, _io=late_io)[0]   # finish: all waited
    torch.testing.assert_close(out, LateUse()(x))
    assert late_io.readied == [0]


def test_pinned_host_buffers_count_what_the_host_allocator_takes(monkeypatch):
    from magis_nb.runtime.module import held_host_bytes

    t = torch.empty(3 * 1024 + 5, dtype=torch.uint8)
    assert held_host_bytes(t) == 3 * 1024 + 5                 # pageable: its bytes
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    assert held_host_bytes(t) == 4096                         # pinned: the next power of two
    assert held_host_bytes(torch.empty(4096, dtype=torch.uint8)) == 4096
