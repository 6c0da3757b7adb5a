"""The generated program against eager PyTorch, and OptimizedModule's contract."""
import copy

import pytest
import torch
import torch.nn.functional as F

from magis_nb.capture import eager_step
from magis_nb.ir import Ref, graph_digest, iter_refs
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


def test_rng_ops_are_chained_in_program_order():
    g = trace(TiedLM(), (torch.randint(0, 50, (2, 5)),) * 2).graph
    for n in g.ops:
        for r in iter_refs((n.args, n.kwargs)):
            assert r.node < n.id  # ids are a topological order
