"""Cost models: exact FLOPs and bytes on hand-made nodes, the roofline on a synthetic
profile, views for free, the measured cost model's disk cache, and paper-size sanity."""
import json
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from magis_nb.ir.graph import Graph, Node, Ref, TensorInfo
from magis_nb.program import trace
from magis_nb.simulate.measured import MeasuredCost
from magis_nb.simulate.cost import (CostModel, RooflineCost, is_free, make_cost,
                                    op_bytes, op_costs, op_flops)
from magis_nb.simulate.latency import program_latency
from magis_nb.simulate.profiles import PROFILES, DeviceProfile, cpu_profile, get_profile

aten = torch.ops.aten
F32 = torch.float32


class G:
    """A tiny graph builder: inputs and ATen op nodes with given output shapes."""

    def __init__(self):
        self.nodes: list[Node] = []

    def input(self, shape, dtype=F32):
        nb = math.prod(shape) * dtype.itemsize
        return self._add("input", "input", None, (), [TensorInfo(tuple(shape), dtype, nb)])

    def op(self, op, args, *outs, alias=None, dtype=F32):
        """outs: output shapes (None for an absent output); alias: the Ref a view shares."""
        infos = []
        for s in outs:
            if s is None:
                infos.append(None)
            elif alias is not None:
                infos.append(TensorInfo(tuple(s), dtype, 0, alias))
            else:
                infos.append(TensorInfo(tuple(s), dtype, math.prod(s) * dtype.itemsize))
        return self._add("op", str(op), op, tuple(args), infos)

    def _add(self, kind, target, op, args, outputs):
        nid = len(self.nodes)
        self.nodes.append(Node(nid, f"n{nid}", kind, target, op, args, {}, outputs,
                               multi=len(outputs) > 1))
        return Ref(nid)

    def graph(self, *outputs):
        return Graph(self.nodes, list(outputs), [("out",)] * len(outputs))


# -- FLOPs ---------------------------------------------------------------------

def test_matmul_flops_exact():
    b = G()
    a, w, bias = b.input((3, 5)), b.input((5, 7)), b.input((7,))
    x, y = b.input((2, 3, 5)), b.input((2, 5, 7))
    mm = b.op(aten.mm.default, (a, w), (3, 7))
    addmm = b.op(aten.addmm.default, (bias, a, w), (3, 7))
    bmm = b.op(aten.bmm.default, (x, y), (2, 3, 7))
    g = b.graph(mm, addmm, bmm)
    assert op_flops(g, mm.node) == 2 * 3 * 5 * 7 == 210
    assert op_flops(g, addmm.node) == 210
    assert op_flops(g, bmm.node) == 420


def _conv(b, x, w, out, stride=1, pad=1, transposed=False, groups=1):
    return b.op(aten.convolution.default,
                (x, w, None, [stride] * 2, [pad] * 2, [1, 1], transposed, [0, 0], groups), out)


def test_conv_flops_exact():
    b = G()
    x = b.input((2, 4, 8, 8))
    w = b.input((6, 4, 3, 3))
    wg = b.input((6, 2, 3, 3))                       # groups=2: Cin/groups = 2
    xt, wt = b.input((2, 4, 5, 5)), b.input((4, 3, 3, 3))   # transposed: (Cin, Cout, k, k)
    c = _conv(b, x, w, (2, 6, 8, 8))
    cg = _conv(b, x, wg, (2, 6, 8, 8), groups=2)
    cs = _conv(b, x, w, (2, 6, 4, 4), stride=2)
    ct = _conv(b, xt, wt, (2, 3, 7, 7), pad=0, transposed=True)
    go = b.input((2, 6, 8, 8))
    bw = b.op(aten.convolution_backward.default,
              (go, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]),
              (2, 4, 8, 8), (6, 4, 3, 3), (6,))
    bw_w = b.op(aten.convolution_backward.default,
                (go, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False]),
                None, (6, 4, 3, 3), None)
    g = b.graph(c, cg, cs, ct, bw, bw_w)
    fwd = 2 * 2 * 64 * 6 * 4 * 9                     # 2 * N * positions * Cout * Cin * k*k
    assert op_flops(g, c.node) == fwd == 55296
    assert op_flops(g, cg.node) == fwd // 2
    assert op_flops(g, cs.node) == fwd // 4
    assert op_flops(g, ct.node) == 2 * 2 * 25 * 4 * 3 * 9
    assert op_flops(g, bw.node) == 2 * fwd + 2 * 6 * 64   # grad_input + grad_weight + grad_bias
    assert op_flops(g, bw_w.node) == fwd


def test_flops_agree_with_torch_flop_counter():
    """Our shapes-only formulas give what torch's FlopCounterMode counts on real tensors."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 9, requires_grad=True)
    # groups=1: torch counts a grouped conv's grad_weight as if ungrouped (x groups);
    # ours is one forward conv, as test_conv_flops_exact checks by hand.
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1)
    convt = nn.ConvTranspose2d(4, 3, 3, stride=2)
    for m in (conv, convt):
        with FlopCounterMode(display=False) as fc:
            y = m(x)
        out = tuple(y.shape)
        b = G()
        xi, wi = b.input(tuple(x.shape)), b.input(tuple(m.weight.shape))
        tr = isinstance(m, nn.ConvTranspose2d)
        n = b.op(aten.convolution.default,
                 (xi, wi, None, list(m.stride), list(m.padding), [1, 1], tr, [0, 0], m.groups), out)
        go = b.input(out)
        bw = b.op(aten.convolution_backward.default,
                  (go, xi, wi, None, list(m.stride), list(m.padding), [1, 1], tr, [0, 0], m.groups,
                   [True, True, False]), tuple(x.shape), tuple(m.weight.shape), None)
        g = b.graph(n, bw)
        assert op_flops(g, n.node) == fc.get_total_flops()
        with FlopCounterMode(display=False) as fb:
            torch.ops.aten.convolution_backward.default(
                torch.randn(out), x.detach(), m.weight.detach(), None, list(m.stride),
                list(m.padding), [1, 1], tr, [0, 0], m.groups, [True, True, False])
        assert op_flops(g, bw.node) == fb.get_total_flops()
    a, c = torch.randn(3, 4, 5), torch.randn(3, 5, 6)
    with FlopCounterMode(display=False) as fc:
        torch.bmm(a, c)
    b = G()
    n = b.op(aten.bmm.default, (b.input((3, 4, 5)), b.input((3, 5, 6))), (3, 4, 6))
    assert op_flops(b.graph(n), n.node) == fc.get_total_flops()


def test_sdpa_flops():
    b = G()
    q, k, v = b.input((2, 4, 16, 8)), b.input((2, 4, 32, 8)), b.input((2, 4, 32, 8))
    fwd = b.op(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, True),
               (2, 4, 16, 8), (2, 4, 16))
    go, o, lse = b.input((2, 4, 16, 8)), b.input((2, 4, 16, 8)), b.input((2, 4, 16))
    bwd = b.op(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
               (go, q, k, v, o, lse, 0.0, True), (2, 4, 16, 8), (2, 4, 32, 8), (2, 4, 32, 8))
    g = b.graph(fwd, bwd)
    one = 2 * (2 * 4) * 16 * 32 * 8
    assert op_flops(g, fwd.node) == 2 * one
    assert op_flops(g, bwd.node) == 4 * one


# -- bytes, views, roofline ----------------------------------------------------

PROF = DeviceProfile("round", {"float32": 1e9, "tfloat32": 2e9}, mem_bw=1e9, host_link_bw=1e8,
                     launch_overhead_s=0.0)


def _chain():
    b = G()
    a, w = b.input((100, 100)), b.input((100, 100))
    mm = b.op(aten.mm.default, (a, w), (100, 100))
    r = b.op(aten.relu.default, (mm,), (100, 100))
    t = b.op(aten.t.default, (r,), (100, 100), alias=r)
    v = b.op(aten.view.default, (t, [10000]), (10000,), alias=r)
    row = b.input((1, 100))
    e = b.op(aten.expand.default, (row, [100, 100]), (100, 100), alias=row)
    add = b.op(aten.add.Tensor, (r, e), (100, 100))
    mask = b.op(aten.empty_strided.default, ([100, 100], [100, 1]), (100, 100), dtype=torch.bool)
    draw = b.op(aten.bernoulli_.float, (mask, 0.5), (100, 100), alias=mask, dtype=torch.bool)
    return b.graph(v, add, draw), dict(mm=mm, r=r, t=t, v=v, e=e, add=add, mask=mask, draw=draw)


def test_bytes_and_free_ops():
    g, n = _chain()
    assert op_bytes(g, n["mm"].node) == 3 * 40000
    assert op_bytes(g, n["r"].node) == 2 * 40000
    # the expand view reads its 400-byte base, not 40000 bytes
    assert op_bytes(g, n["add"].node) == 40000 + 400 + 40000
    for k in ("t", "v", "e", "mask"):
        assert is_free(g.nodes[n[k].node]) and op_bytes(g, n[k].node) == 0
    # an in-place op's output aliases its input, but it writes: not free
    assert not is_free(g.nodes[n["draw"].node])
    assert op_bytes(g, n["draw"].node) == 2 * 10000


def test_roofline_is_max_of_compute_and_memory():
    g, n = _chain()
    c = RooflineCost(PROF)
    # mm: 2e6 FLOP at the tf32 peak (2e9) = 1 ms > 120 kB at 1 GB/s = 0.12 ms
    assert c.op_cost(g, n["mm"].node) == pytest.approx(1e-3)
    assert RooflineCost(PROF, tf32=False).op_cost(g, n["mm"].node) == pytest.approx(2e-3)
    # relu: 1e4 FLOP = 10 us < 80 kB = 80 us
    assert c.op_cost(g, n["r"].node) == pytest.approx(80e-6)
    for k in ("t", "v", "e", "mask"):
        assert c.op_cost(g, n[k].node) == 0.0
    launch = RooflineCost(DeviceProfile("l", PROF.flops, 1e9, 1e8, 1e-3))
    assert launch.op_cost(g, n["r"].node) == pytest.approx(80e-6 + 1e-3)
    assert launch.op_cost(g, n["t"].node) == 0.0
    assert c.transfer_cost(10**8) == pytest.approx(1.0)
    assert c.transfer_cost(0) == 0.0
    assert isinstance(c, CostModel)
    table = op_costs(g, c)
    assert sorted(table) == g.program_order()
    assert sum(table.values()) == pytest.approx(1e-3 + 80e-6 + 80.4e-6 + 20e-6)


def test_profiles():
    assert set(PROFILES) == {"rtx3090", "a100", "h100", "h200"}
    p = get_profile("RTX3090")
    assert p.peak("tfloat32") == 35.6e12 and p.mem_bw == 936e9
    assert get_profile("a100").peak("bfloat16") == 312e12
    assert get_profile("h200").flops == get_profile("h100").flops
    assert get_profile("h200").mem_bw > get_profile("h100").mem_bw
    assert p.peak("int64") == p.peak("float32")
    with pytest.raises(KeyError):
        get_profile("tpu")
    assert make_cost("a100").profile is PROFILES["a100"]
    assert make_cost("roofline:h100").profile is PROFILES["h100"]
    cpu = cpu_profile()
    assert cpu is get_profile("cpu")         # measured once, then cached
    for v in (cpu.flops["float32"], cpu.flops["bfloat16"], cpu.mem_bw, cpu.launch_overhead_s):
        assert math.isfinite(v) and v > 0
    # a CPU swap is a copy: n bytes read and n written, as the roofline prices a copy_
    assert make_cost("cpu").transfer_cost(2**20) == pytest.approx(2 * 2**20 / cpu.mem_bw)


# -- fission parts cost one part each ------------------------------------------

class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc(x).relu()


def test_fission_parts_sum_to_the_whole():
    from magis_nb.analysis import DGraph, apply_fission, check
    from magis_nb.analysis.ftrans import FTrans

    prog = trace(Lin(), (torch.randn(8, 32),), mode="infer")
    dg = DGraph(prog.graph)
    ops = frozenset(n.id for n in prog.graph.ops if not is_free(n))
    comp = next(c for c in dg.components if ops <= set(c.axis_of) and c.size == 8)
    assert check(dg, ops, comp.id, 4) is None
    split = apply_fission(dg, [FTrans(ops, comp.id, 4)])

    def mm_flops(g):
        return sum(op_flops(g, n) for n in g.ops if n.target in ("aten.addmm.default", "aten.mm.default"))

    assert mm_flops(split) == mm_flops(prog.graph) == 2 * 8 * 32 * 16
    assert sum(1 for n in split.ops if n.target == "aten.addmm.default") == 4


# -- measured costs --------------------------------------------------------------

class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 5)

    def forward(self, ids):
        return self.fc(self.emb(ids).relu()).mean(1)


@pytest.fixture(scope="module")
def small_program():
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (4, 3))
    target = torch.randint(0, 5, (4,))
    return trace(Small(), (ids, target), loss_fn=nn.functional.cross_entropy)


def test_measured_cost_and_its_disk_cache(small_program, tmp_path, monkeypatch):
    g = small_program.graph
    monkeypatch.setattr(MeasuredCost, "busy", lambda self: False)    # an idle machine
    before = torch.random.get_rng_state()
    mc = MeasuredCost("cpu", cache_dir=tmp_path, reps=2)
    costs = op_costs(g, mc)
    mc.save()
    assert torch.equal(torch.random.get_rng_state(), before)   # timing draws no caller RNG
    assert all(math.isfinite(v) and v >= 0 for v in costs.values())
    assert mc.timed == len(mc.table) > 0
    assert all(v is not None for v in mc.table.values())        # every op here runs
    assert mc.path.parent == tmp_path and mc.path.name.startswith(f"costs-{torch.__version__}")
    on_disk = json.loads(mc.path.read_text())["ops"]
    assert on_disk == mc.table

    calls = []
    monkeypatch.setattr(MeasuredCost, "time_op", lambda self, *a: calls.append(a) or 1.0)
    monkeypatch.setenv("MAGIS_NB_CACHE_DIR", str(tmp_path))
    again = MeasuredCost("cpu")
    assert again.path == mc.path
    assert op_costs(g, again) == costs
    assert calls == [] and again.timed == 0
    assert again.measure(g) == 0
    lat = program_latency(small_program, again)
    assert lat.total_s == pytest.approx(sum(costs.values()))


def test_timings_on_a_busy_cpu_are_not_saved(small_program, tmp_path, monkeypatch):
    """Note [timings taken on a busy CPU]: an op whose canary ran slow (before
    or after it) is priced for this instance but not written to the cache; the
    next instance times it again. An op's time is the least of its repetitions."""
    import magis_nb.simulate.measured as measured

    g = small_program.graph
    ops = [n for n in g.ops if isinstance(n.op, torch._ops.OpOverload)][:3]
    canary = iter([1e-4,            # first op: its before sets the best
                   1e-4, 1e-4,      # .. after; second op: before
                   9e-4,            # .. after: busy
                   1e-4, 1e-4])     # third op: idle again
    monkeypatch.setattr(MeasuredCost, "canary", lambda self: next(canary))
    reps = iter([3e-3, 1e-3, 2e-3] * 3)
    monkeypatch.setattr(measured, "call_seconds", lambda *a, **k: next(reps))
    mc = MeasuredCost("cpu", cache_dir=tmp_path, reps=3)
    keys = [mc.signature(g, n) for n in ops]
    assert len(set(keys)) == 3
    assert [mc.op_cost(g, n) for n in ops] == [1e-3] * 3      # least of 3e-3, 1e-3, 2e-3
    assert mc.unsaved == {keys[1]} and mc.canary_best == 1e-4
    # written at once for the first new timing, then at most every SAVE_EVERY s
    assert set(json.loads(mc.path.read_text())["ops"]) == {keys[0]}
    mc.save()
    data = json.loads(mc.path.read_text())
    assert set(data["ops"]) == {keys[0], keys[2]} and data["canary"] == 1e-4
    monkeypatch.setattr(MeasuredCost, "busy", lambda self: False)
    monkeypatch.setattr(MeasuredCost, "time_op", lambda self, *a: 5e-4)
    again = MeasuredCost("cpu", cache_dir=tmp_path)
    assert again.canary_best == 1e-4
    assert [again.op_cost(g, n) for n in ops] == [1e-3, 5e-4, 1e-3]   # only the busy one again


def test_new_timings_are_written_at_most_every_few_seconds(small_program, tmp_path,
                                                           monkeypatch):
    """Each write rewrites the whole cache file: the first new timing is
    written at once, the next ones after SAVE_EVERY seconds, by `save`, or
    at exit (measured.py's docstring)."""
    import magis_nb.simulate.measured as measured

    g = small_program.graph
    ops = [n for n in g.ops if isinstance(n.op, torch._ops.OpOverload)][:3]
    monkeypatch.setattr(MeasuredCost, "busy", lambda self: False)
    monkeypatch.setattr(MeasuredCost, "time_op", lambda self, *a: 2e-3)
    mc = MeasuredCost("cpu", cache_dir=tmp_path)
    for n in ops:
        mc.op_cost(g, n)
    assert len(json.loads(mc.path.read_text())["ops"]) == 1
    measured.save_at_exit()
    assert len(json.loads(mc.path.read_text())["ops"]) == len(mc.table) == 3
    monkeypatch.setattr(measured, "SAVE_EVERY", 0.0)
    mc.table.clear()
    mc.op_cost(g, ops[0])               # due: written at once
    assert mc not in measured.DIRTY


def test_measured_cost_falls_back_when_an_op_cannot_run(tmp_path):
    b = G()
    x = b.input((4, 4))
    bad = b.op(None, (x,), (4, 4))              # no ATen callable
    g = b.graph(bad)
    fb = RooflineCost(PROF)
    mc = MeasuredCost("cpu", cache_dir=tmp_path, fallback=fb)
    assert mc.op_cost(g, bad.node) == fb.op_cost(g, bad.node) > 0
    assert list(json.loads(mc.path.read_text())["ops"].values()) == [None]
    assert mc.transfer_cost(0) == 0.0 and mc.transfer_cost(10**6) > 0
    assert make_cost("measured", cache_dir=tmp_path).path == mc.path


# -- paper size on meta ------------------------------------------------------------

def test_roofline_resnet50_paper_on_meta():
    """ResNet-50 b64 224px: ~4.1 GMAC per image forward, a training step ~3x forward."""
    from magis_nb import zoo

    case = zoo.build("resnet", "paper", device="meta")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    flops = sum(op_flops(prog.graph, n) for n in prog.graph.ops)
    assert 1.4e12 < flops < 1.8e12
    res = {p: program_latency(prog, RooflineCost(p)).total_s for p in ("rtx3090", "a100", "h100", "h200")}
    print("resnet paper roofline:", {k: f"{v * 1e3:.1f} ms" for k, v in res.items()})
    assert 0.02 < res["rtx3090"] < 10
    assert res["rtx3090"] > res["a100"] > res["h100"] > res["h200"]


def test_a_timing_from_the_file_is_confirmed_once_per_process(small_program, tmp_path,
                                                              monkeypatch):
    """Note [a timing is confirmed once per process]: an op another process timed
    is timed once more on its first use here; its price is the median of the
    last SAMPLES timings, which the file keeps; the next use times nothing; a
    timing taken while the canary says busy adds no sample."""
    import magis_nb.simulate.measured as measured

    g = small_program.graph
    ops = [n for n in g.ops if isinstance(n.op, torch._ops.OpOverload)][:3]
    monkeypatch.setattr(MeasuredCost, "busy", lambda self: False)
    first = MeasuredCost("cpu", cache_dir=tmp_path)
    keys = [first.signature(g, n) for n in ops]
    # as a file from other processes: one stale high timing, five timings, an unrunnable op
    first.path.write_text(json.dumps({"ops": {keys[0]: 5e-3, keys[1]: [1, 2, 3, 4, 5],
                                              keys[2]: None}}))
    monkeypatch.setattr(measured, "CONFIRMED", set())
    calls = []
    monkeypatch.setattr(MeasuredCost, "time_op", lambda self, *a: calls.append(a) or 1e-3)
    mc = MeasuredCost("cpu", cache_dir=tmp_path)
    assert mc.op_cost(g, ops[0]) == pytest.approx(3e-3)   # the median of 5e-3 and 1e-3
    assert mc.op_cost(g, ops[1]) == 3                      # of 2, 3, 4, 5, 1e-3: the oldest dropped
    assert mc.op_cost(g, ops[2]) == mc.fallback.op_cost(g, ops[2])   # unrunnable: not timed
    assert len(calls) == 2
    assert mc.op_cost(g, ops[0]) == pytest.approx(3e-3) and len(calls) == 2
    mc.save()
    ops_on_disk = json.loads(mc.path.read_text())["ops"]
    assert ops_on_disk[keys[0]] == [5e-3, 1e-3] and ops_on_disk[keys[1]] == [2, 3, 4, 5, 1e-3]
    # another instance in this process: confirmed already
    again = MeasuredCost("cpu", cache_dir=tmp_path)
    assert again.op_cost(g, ops[0]) == pytest.approx(3e-3) and len(calls) == 2

    # busy while confirming: the file's median is used and the op asked again next time
    monkeypatch.setattr(measured, "CONFIRMED", set())
    busy = iter([True, False, False, False])
    monkeypatch.setattr(MeasuredCost, "busy", lambda self: next(busy))
    monkeypatch.setattr(MeasuredCost, "time_op", lambda self, *a: 1e-4)
    mc = MeasuredCost("cpu", cache_dir=tmp_path)
    assert mc.op_cost(g, ops[0]) == pytest.approx(3e-3)   # busy: no sample
    assert mc.op_cost(g, ops[0]) == pytest.approx(1e-3)   # median of 5e-3, 1e-3, 1e-4
