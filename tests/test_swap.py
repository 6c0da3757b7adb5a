"""Swapping: exact device memory (host buffers excluded), eager equality, inverse."""
import torch

from magis_nb.ir import Ref, graph_digest
from magis_nb.program import trace
from magis_nb.rules import swap, unswap
from magis_nb.rules.swap import pool_inputs
from magis_nb.runtime import measure_cpu

from test_remat import LateUse, late_use_ids

MiB = 2**20


def test_swap_lowers_the_device_peak_exactly():
    """As remat (test_remat.py), a leaves device memory after t1 and comes back
    before the last add: 5 MiB -> 4 MiB; its 1 MiB host copy is not device memory."""
    x = torch.randn(MiB // 4)
    prog = trace(LateUse(), (x,), mode="infer")
    a, late = late_use_ids(prog)
    sw = prog.with_graph(swap(prog.graph, Ref(a, 0), [late]))
    assert sw.simulate().peak == 4 * MiB
    mod = sw.module()
    assert len(mod.host_buffers) == 1 and mod.host_buffers[0].numel() == MiB // 4
    # the plan's graph says what host memory its module will hold, without building it
    assert [n.outputs[0].nbytes for n in pool_inputs(sw.graph)] == [MiB]
    m = measure_cpu(lambda: mod(x), [x])
    assert m.peak == 4 * MiB
    torch.testing.assert_close(m.result, LateUse()(x))
    out2 = mod(x)                       # the host buffer is reused across calls
    torch.testing.assert_close(out2, LateUse()(x))
    assert "_io.store(0, host0_" in mod.code and "_io.load(0, " in mod.code


def test_unswap_restores_the_digest():
    prog = trace(LateUse(), (torch.randn(64),), mode="infer")
    a, late = late_use_ids(prog)
    g2 = swap(prog.graph, Ref(a, 0), [late])
    load = [n.id for n in g2.ops if n.target == "aten._to_copy.default"][0]
    assert graph_digest(unswap(g2, load)) == graph_digest(prog.graph)


def test_swap_in_a_training_step_matches_eager():
    """Swap each relu output out for all its readers in the backward (directly or
    through detach views); the best one lowers the simulated peak, and every plan
    runs allclose to eager at exactly its simulated peak."""
    from magis_nb import zoo
    from magis_nb.ir import iter_refs
    from magis_nb.verify import Reference
    case = zoo.build("mlp", "tiny")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    g = prog.graph
    peaks = []
    for relu in [n.id for n in g.ops if n.target == "aten.relu.default"]:
        late = [n.id for n in g.ops if n.category == "gradient"
                and any(g.storage_of(r) == Ref(relu, 0) for r in iter_refs((n.args, n.kwargs)))]
        if late:
            sw = prog.with_graph(swap(g, Ref(relu, 0), late))
            chk = ref.check(sw.module())
            assert chk.comparison.allclose, chk.comparison.mismatches
            assert chk.measured_peak == sw.simulate().peak
            peaks.append(chk.measured_peak)
    assert peaks and min(peaks) < prog.simulate().peak
