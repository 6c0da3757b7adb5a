"""The generated program against eager PyTorch, and OptimizedModule's contract."""
import copy
import heapq

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from magis_nb.capture import eager_step
from magis_nb.ir import Ref, graph_digest
from magis_nb.program import trace
from magis_nb.verify import check_step, compare_models

from edge_models import BNDropNet, DataclassOut, TiedLM, TupleOut


def _xy():
    return torch.randn(16, 8), torch.randint(0, 4, (16,))


@pytest.mark.parametrize("make,inputs,loss_fn", [
    (BNDropNet, _xy(), F.cross_entropy),
    (TiedLM, (torch.randint(0, 50, (4, 7)), torch.randint(0, 50, (4, 7))), None),
    (DataclassOut, (torch.randn(5, 6),), None),
    (TupleOut, (torch.randn(5, 6),), None),
])
def test_training_step_matches_eager(make, inputs, loss_fn):
    model = make().train()
    prog = trace(model, inputs, loss_fn=loss_fn)
    chk = check_step(model, inputs, loss_fn, "train", lambda m: prog.module(), seed=3)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == prog.simulate().peak


def test_grads_accumulate_like_autograd_and_optimizers_work():
    torch.manual_seed(0)
    model = BNDropNet()
    ref = copy.deepcopy(model)
    x, y = _xy()
    opt_mod = trace(model, (x, y), loss_fn=F.cross_entropy).module()
    sgd, sgd_ref = torch.optim.SGD(model.parameters(), 0.1), torch.optim.SGD(ref.parameters(), 0.1)
    for step in range(3):
        for _ in range(2):  # two micro-steps accumulate into .grad
            torch.manual_seed(step)
            loss = opt_mod(x, y)
            loss.backward()
            loss = loss.detach()
            torch.manual_seed(step)
            ref_loss = eager_step(ref, (x, y), F.cross_entropy)
        cmp = compare_models(ref, model, ref_loss, loss)
        assert cmp.allclose, cmp.mismatches
        sgd.step(), sgd_ref.step()
        sgd.zero_grad(), sgd_ref.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_infer_mode_returns_the_model_structure():
    model = TiedLM().eval()
    ids = torch.randint(0, 50, (2, 5))
    mod = trace(model, (ids, ids), mode="infer").module()
    out = mod(ids, ids)
    ref = model(ids, ids)
    assert set(out) == {"loss", "logits"}
    torch.testing.assert_close(out["logits"], ref["logits"])


def test_other_shapes_raise_a_clear_error():
    mod = trace(BNDropNet(), _xy(), loss_fn=F.cross_entropy).module()
    with pytest.raises(ValueError, match="planned for"):
        mod(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    with pytest.raises(TypeError, match=r"planned for a call like \(<tensor>, <tensor>\)"):
        mod(torch.randn(16, 8))


def test_simulated_aliasing_matches_runtime_storage_sharing():
    """Run the program op by op with real tensors: outputs the IR calls views share
    their base's storage, and every other output owns a fresh one."""
    model = TiedLM()
    inputs = (torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5)))
    prog = trace(model, inputs)
    g = prog.graph
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    vals, ptrs = {}, set()
    for n in g.inputs:
        kind, key = n.role
        t = params[key] if kind == "param" else buffers[key] if kind == "buffer" else inputs[key]
        vals[Ref(n.id, 0)] = t
        ptrs.add(t.untyped_storage().data_ptr())

    def sub(a):
        if isinstance(a, Ref):
            return vals[a]
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    with torch.no_grad():
        for nid in g.program_order():
            n = g.nodes[nid]
            out = n.op(*sub(n.args), **{k: sub(v) for k, v in n.kwargs.items()})
            outs = list(out) if n.multi else [out]
            for i, t in enumerate(outs):
                if n.outputs[i] is None:
                    continue
                r = Ref(nid, i)
                base = g.storage_of(r)
                ptr = t.untyped_storage().data_ptr()
                if t.numel() == 0:
                    pass
                elif base != r:
                    assert ptr == vals[base].untyped_storage().data_ptr(), n.target
                else:
                    assert ptr not in ptrs, f"{n.target} returned an existing storage"
                vals[r] = t
                ptrs.add(ptr)


def test_digest_is_stable_and_structural():
    a = trace(BNDropNet(), _xy(), loss_fn=F.cross_entropy).graph
    b = trace(BNDropNet(), _xy(), loss_fn=F.cross_entropy).graph
    c = trace(BNDropNet(), (torch.randn(32, 8), torch.randint(0, 4, (32,))),
              loss_fn=F.cross_entropy).graph
    assert graph_digest(a) == graph_digest(b)
    assert graph_digest(a) != graph_digest(c)
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]


class _Branches(nn.Module):
    """Three dropouts on independent branches: no data edge orders their draws."""

    def __init__(self):
        super().__init__()
        self.ls = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return sum(F.dropout(lin(x), 0.5, self.training) for lin in self.ls).pow(2).mean()


def _latest_first(preds: list[list[int]]) -> list[int]:
    """The topological order of ``preds`` that always runs the latest ready op:
    the one furthest from program order (the last branch's ops before the first's)."""
    succs, indeg = [[] for _ in preds], [len(p) for p in preds]
    for v, ps in enumerate(preds):
        for p in ps:
            succs[p].append(v)
    ready = [-v for v in range(len(preds)) if not indeg[v]]
    heapq.heapify(ready)
    out = []
    while ready:
        v = -heapq.heappop(ready)
        out.append(v)
        for s in succs[v]:
            indeg[s] -= 1
            if not indeg[s]:
                heapq.heappush(ready, -s)
    return out


def test_rng_ops_are_chained_in_program_order():
    """Graph's RNG chain: every schedule keeps the RNG ops in captured order, so a
    re-ordered program draws eager's random numbers (the same dropout masks).
    The order that runs the latest ready op first reverses the branches; with
    the chain its draws stay in captured order and the step matches eager under
    the same seed. On data edges alone the same rule reverses the draws, and
    that step does not match: the check sees the masks."""
    torch.manual_seed(0)
    model, x = _Branches().train(), torch.randn(16, 8)
    prog = trace(model, (x,))
    g, mg = prog.graph, prog.memgraph
    captured = [n.id for n in g.ops if n.rng]
    assert len(captured) == 3
    order = _latest_first(mg.preds)
    assert mg.is_topological(order)
    nodes = prog.to_node_order(order)
    addmms = [nid for nid in nodes if g.nodes[nid].target == "aten.addmm.default"]
    assert addmms == sorted(addmms, reverse=True)        # the branches do run reversed
    assert [nid for nid in nodes if g.nodes[nid].rng] == captured
    mod = prog.module(order)
    names = [g.nodes[nid].name for nid in captured]
    lines = [ln.strip() for ln in mod.code.splitlines()]
    drawn = [next(i for i, ln in enumerate(lines) if ln.startswith(nm + " = ")) for nm in names]
    assert drawn == sorted(drawn)                       # the generated program draws in that order
    chk = check_step(model, (x,), None, "train", lambda m: mod, seed=3)
    assert chk.comparison.allclose, chk.comparison.mismatches

    index = {nid: i for i, nid in enumerate(prog.op_ids)}
    data_preds = [sorted({index[r.node] for r in g.nodes[nid].refs() if r.node in index}
                         | {index[d] for d in g.nodes[nid].deps if d in index})
                  for nid in prog.op_ids]
    unchained = prog.to_node_order(_latest_first(data_preds))
    assert [nid for nid in unchained if g.nodes[nid].rng] == captured[::-1]
    chk = check_step(model, (x,), None, "train", lambda m: prog.module(_latest_first(data_preds)),
                     seed=3)
    assert not chk.comparison.allclose
