"""The CUDA copy path's protocol, checked on the CPU (issue 56 item 1).

The generated program runs with `CudaCopies` on the stand-in of its streams
(tests/cuda_standin.py), where a copy happens only once the compute stream
waits for it and a copy whose tensor the program freed first is a violation.
So: every Store is waited for before its tensor is freed (Note [a Store's free
point] in runtime/copies.py), every Load is readied before a reader touches its
data, and where the program waits is where the latency simulator makes compute
wait (`search.transfers_of`), op for op.
"""
from __future__ import annotations

import re

import torch
from cuda_standin import StandInStreams
from test_copies import _prefetch_order, simulated_peak, swapped_gpt

from magis_nb import zoo
from magis_nb.ir.graph import Ref
from magis_nb.ir.passes import written_in_place
from magis_nb.program import trace
from magis_nb.rules.swap import swap_all, swap_ops
from magis_nb.runtime import OptimizedModule
from magis_nb.runtime.copies import CudaCopies
from magis_nb.search.transfers import transfers_of
from magis_nb.verify import Reference


def _events(g) -> int:
    stores, loads = swap_ops(g)
    return max(len(stores), len(loads))


def _on_standin(mod, g, cls=CudaCopies):
    streams = StandInStreams()
    mod.copies = cls(_events(g), "cpu", streams=streams)
    return streams


def test_the_cuda_copy_path_trains_like_eager_on_the_stand_in():
    case, prog, sg, order = swapped_gpt()
    mod = OptimizedModule(case.model, prog.captured, sg, order)
    streams = _on_standin(mod, sg)
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    chk = ref.check(mod)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert streams.violations == [] and streams.pending() == 0
    stores, loads = swap_ops(sg)
    assert sum(1 for e in streams.log if e[0] == "copied") == len(stores) + len(loads)
    assert chk.measured_peak == simulated_peak(sg, order)


class _NoStoreWait(CudaCopies):
    """The protocol before Note [a Store's free point]: nothing waits for a
    Store (record_stream kept the block on a GPU, and the simulator did not
    know it)."""

    def stored(self, k, pool):
        return pool


class _NoReady(CudaCopies):
    def ready(self, k):
        pass


def test_the_stand_in_sees_a_store_freed_before_its_copy_and_a_load_read_early():
    """Negative controls: the stand-in fails both faults it is there to see."""
    case, prog, sg, order = swapped_gpt()
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    mod = OptimizedModule(case.model, prog.captured, sg, order)
    streams = _on_standin(mod, sg, _NoStoreWait)
    try:    # the Load then copies a buffer never filled: garbage indices may raise
        ref.check(mod)
    except IndexError:
        pass
    assert any("freed while a copy reads it" in v for v in streams.violations)
    mod = OptimizedModule(case.model, prog.captured, sg, order)
    streams = _on_standin(mod, sg, _NoReady)
    try:    # the poison: NaN in floats, -7 in an index (an embedding refuses it)
        assert not ref.check(mod).comparison.allclose
    except IndexError as e:
        assert "-7" in str(e) or "index out of range" in str(e)


def swapped_plain_gpt():
    """Tiny GPT (no fission: no loops in its program) with every activation
    swapped out to all its readers."""
    case = zoo.build("gpt", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    g = prog.graph
    rd, written = g.readers(), written_in_place(g)
    specs = [(Ref(n.id, k), rd[Ref(n.id, k)]) for n in g.ops
             if n.category == "activation"
             for k, t in enumerate(n.outputs)
             if t is not None and t.alias is None and Ref(n.id, k) not in written
             and rd.get(Ref(n.id, k))]
    return case, prog, swap_all(g, specs)


_CALL = re.compile(r"_io\.(store|stored|load|ready)\((\d+)")


def _waits_in_code(g, order, code: str) -> list[tuple]:
    """(kind, compute op before the copy is issued, compute op that waits for
    it) per transfer, read off the generated program's lines."""
    stores, loads = swap_ops(g)
    moving = set(stores) | set(loads)
    var = {}
    for v in order:
        n = g.nodes[v]
        if v not in moving:
            var[f"{n.name}_0" if n.multi else n.name] = v
    issued, waiting, out = {}, [], []
    last = None
    for line in code.splitlines()[1:]:
        line = line.strip()
        m = _CALL.search(line)
        if m:
            kind, k = m.group(1), int(m.group(2))
            if kind in ("store", "load"):
                issued[(kind, k)] = last
            else:
                waiting.append(("store" if kind == "stored" else "load", k))
            continue
        lhs = line.split(" = ", 1)[0].split(",")[0].strip() if " = " in line else None
        if lhs in var:
            for key in waiting:
                out.append((key[0], issued[key], var[lhs]))
            waiting = []
            last = var[lhs]
    out += [(key[0], issued[key], None) for key in waiting]
    return out


def test_codegen_and_the_simulated_transfers_agree_op_for_op():
    case, prog, sg = swapped_plain_gpt()
    stores, loads = swap_ops(sg)
    assert len(stores) >= 8
    for order in (_prefetch_order(sg), sg.program_order()):
        mod = OptimizedModule(case.model, prog.captured, sg, order)
        assert "for _k in" not in mod.code
        _, xs = transfers_of(sg, order)
        simulated = sorted((t.kind, t.after, t.before) for t in xs)
        assert sorted(_waits_in_code(sg, order, mod.code), key=str) == sorted(simulated, key=str)
        streams = _on_standin(mod, sg)
        ref = Reference(case.model, case.inputs, case.loss_fn, "train")
        chk = ref.check(mod)
        assert chk.comparison.allclose and not streams.violations and not streams.pending()


def test_a_load_read_only_through_views_waits_before_the_view_is_read():
    """A loaded copy whose first readers are views: the program readies it where
    the first op touches its data, as the simulator has compute wait there."""
    x = torch.randn(8, 16)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    prog = trace(model, (x,), mode="infer")
    g = prog.graph
    rd = g.readers()
    tanh = next(n for n in g.ops if n.target == "aten.tanh.default")
    sg = swap_all(g, [(Ref(tanh.id, 0), rd[Ref(tanh.id, 0)])])
    order = _prefetch_order(sg)
    mod = OptimizedModule(model, prog.captured, sg, order)
    _, xs = transfers_of(sg, order)
    assert sorted(_waits_in_code(sg, order, mod.code), key=str) == \
        sorted(((t.kind, t.after, t.before) for t in xs), key=str)
    streams = _on_standin(mod, sg)
    with torch.no_grad():
        out = mod(x)
    torch.testing.assert_close(out, model(x))
    assert not streams.violations
