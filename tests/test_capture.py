"""Capture: signature, edge cases, clear errors, the user's model left untouched."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from magis_nb.capture import CaptureError, capture
from magis_nb.ir import build_graph

from edge_models import BNDropNet, DataclassOut, DataDependent, TiedLM, TupleOut


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}, [p.requires_grad for p in m.parameters()]


def _same_state(m, st):
    sd, rg = st
    return (all(torch.equal(sd[k], v) for k, v in m.state_dict().items())
            and rg == [p.requires_grad for p in m.parameters()])


def test_signature_bn_dropout_unused_head():
    m = BNDropNet().train()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    st = _state(m)
    cap = capture(m, (x, y), loss_fn=F.cross_entropy)
    assert _same_state(m, st), "capture must not change the model (running stats included)"
    roles = cap.output_roles
    assert ("loss",) in roles
    assert {r[1] for r in roles if r[0] == "buffer"} == {
        "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    grads = {r[1] for r in roles if r[0] == "grad"}
    assert grads == {"l1.weight", "l1.bias", "bn.weight", "bn.bias", "l2.weight", "l2.bias"}
    assert sorted(cap.no_grad_params) == ["unused_head.bias", "unused_head.weight"]
    g = build_graph(cap)
    assert any(n.rng for n in g.ops), "dropout is an RNG op"
    assert not any(n.target.endswith("_") and "." not in n.target for n in g.ops)


def test_tied_weights_are_one_parameter():
    m = TiedLM()
    cap = capture(m, (torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))))
    assert cap.tied == {"out.weight": "emb.weight"}
    assert "out.weight" not in cap.param_names  # one placeholder for the shared tensor
    g = build_graph(cap)
    mg, _, _ = g.memgraph()
    assert mg.resident_bytes == sum(p.numel() * 4 for p in m.parameters()) + 2 * 2 * 5 * 8


@pytest.mark.parametrize("model", [DataclassOut(), TupleOut()])
def test_own_loss_from_structured_outputs(model):
    cap = capture(model, (torch.randn(3, 6),))
    assert cap.output_roles[0] == ("loss",) or ("loss",) in cap.output_roles


def test_infer_mode_keeps_output_structure():
    cap = capture(TiedLM().eval(), (torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))),
                  mode="infer")
    assert [r[0] for r in cap.output_roles] == ["output", "output"]
    assert cap.out_spec[0] == "dict"


def test_fake_capture_allocates_nothing():
    with torch.device("meta"):
        big = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(4)])  # 1 GiB of weights
        x = torch.randn(4096, 8192)
    cap = capture(big, (x, torch.zeros(1, device="meta")),
                  loss_fn=lambda out, _: out.pow(2).mean())
    g = build_graph(cap)
    # 4 activations of 128 MiB and more in the backward, none of them allocated.
    assert g.summary()["bytes_by_category"]["activation"] >= 4 * 2**27


def test_error_data_dependent_control_flow_names_the_line():
    # On the meta device there is no value to specialize on (Note [specialized scalars]).
    with torch.device("meta"):
        m = DataDependent()
        x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match="control flow") as e:
        capture(m, (x,))
    assert "the offending line" in str(e.value)


def test_error_inputs_do_not_fit():
    m = BNDropNet()
    st = _state(m)
    with pytest.raises(CaptureError, match="do not fit"):
        capture(m, (torch.randn(16, 9), torch.zeros(16, dtype=torch.long)), loss_fn=F.cross_entropy)
    assert _same_state(m, st)


def test_error_non_tensor_input():
    with pytest.raises(CaptureError, match="no tensor"):
        capture(BNDropNet(), (3, "a"))
    with pytest.raises(CaptureError, match="must be a tensor, a tuple"):
        capture(BNDropNet(), 3)


def test_error_loss_not_scalar():
    with pytest.raises(CaptureError, match="scalar"):
        capture(nn.Linear(4, 4), (torch.randn(5, 4),))


def test_error_no_loss_in_output():
    with pytest.raises(CaptureError, match=r"no scalar loss in it \(out\[.logits.\] \(2, 3\)\)"):
        capture(_NoLoss(), (torch.randn(2, 3),))


class _NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x):
        return {"logits": self.l(x)}


def test_unused_param_flags_restored_after_capture():
    m = BNDropNet()
    m.l1.bias.requires_grad_(False)  # a frozen parameter stays frozen, others trainable
    before = [p.requires_grad for p in m.parameters()]
    capture(m, (torch.randn(16, 8), torch.randint(0, 4, (16,))), loss_fn=F.cross_entropy)
    assert [p.requires_grad for p in m.parameters()] == before
    copy.deepcopy(m)  # still a normal module


class _NoParams(nn.Module):
    def forward(self, x):
        return x.relu().sum()


def test_error_loss_without_trainable_parameters():
    with pytest.raises(CaptureError, match="trainable parameter"):
        capture(_NoParams(), (torch.randn(3, 3),))


class _PlainPositions(nn.Module):
    """A position table held as a plain attribute, not a buffer (as VideoMAE and
    many hand-written transformers hold theirs), read under .to(device)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.pe = torch.linspace(-1, 1, 6 * 8).view(1, 6, 8)

    def forward(self, x):
        return self.lin(x + self.pe.detach().to(x.device)).relu()


def test_plain_tensor_attributes_are_read_like_buffers():
    import magis_nb
    from magis_nb.verify import Reference
    torch.manual_seed(0)
    model = _PlainPositions()
    x, y = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    cap = capture(model, (x, y), loss_fn=F.mse_loss)
    assert "pe" in cap.buffer_names and "pe" not in dict(model.named_buffers())
    res = magis_nb.optimize(model, (x, y), loss_fn=F.mse_loss, max_states=4)
    ref = Reference(model, (x, y), F.mse_loss, "train")
    chk = ref.check(res.module)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == res.plan.peak
    # read off the model at every call, as eager reads it
    model.pe = torch.zeros(1, 6, 8)
    ref = Reference(model, (x, y), F.mse_loss, "train")
    chk = ref.check(res.module)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert not isinstance(model.pe, nn.Parameter) and "pe" not in dict(model.named_buffers())


class _SequenceBatchNorm(nn.Module):
    """BatchNorm1d over the channels of a [B, L, C] sequence, and a prediction
    transposed back before the loss (PatchTST's layout)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(16)
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(self.bn(x.transpose(1, 2)).transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("loss_fn", [F.mse_loss, F.smooth_l1_loss, F.huber_loss])
def test_layouts_of_batch_norm_and_loss_gradients_are_atens(loss_fn):
    """ATen lays BatchNorm's output and these losses' input gradients out
    contiguous where the decompositions keep a transposed input's strides; the
    capture traced views the real tensors cannot take (Note [BatchNorm's output
    layout])."""
    import magis_nb
    from magis_nb.verify import Reference
    torch.manual_seed(0)
    model = _SequenceBatchNorm()
    x, y = torch.randn(12, 4, 16), torch.randn(12, 8, 4)
    res = magis_nb.optimize(model, (x, y), loss_fn=loss_fn, mem_budget=0.7, max_states=12)
    ref = Reference(model, (x, y), loss_fn, "train")
    for plan in res.pareto:
        chk = ref.check(res.module_for(plan))
        assert chk.comparison.allclose and chk.measured_peak == plan.peak, plan


def test_a_compiled_model_is_planned_as_the_module_it_wraps():
    import magis_nb
    from magis_nb.verify import Reference
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = torch.compile(inner)          # wraps lazily: nothing compiles here
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    res = magis_nb.optimize(model, (x, y), loss_fn=F.cross_entropy, max_states=4)
    assert res.module.model is inner
    chk = Reference(inner, (x, y), F.cross_entropy, "train").check(res.module)
    assert chk.comparison.allclose


def test_error_forward_writes_a_parameter():
    model = nn.Sequential(nn.Embedding(32, 8, max_norm=1.0), nn.Flatten(), nn.Linear(8 * 6, 3))
    before = model[0].weight.detach().clone()
    with pytest.raises(CaptureError, match="writes into a trainable parameter"):
        capture(model, (torch.randint(0, 32, (4, 6)), torch.randint(0, 3, (4,))),
                loss_fn=F.cross_entropy)
    assert torch.equal(model[0].weight, before)


def test_error_sparse_gradients():
    model = nn.Sequential(nn.Embedding(32, 8, sparse=True), nn.Flatten(), nn.Linear(8 * 6, 3))
    dense = nn.ModuleDict({"sparse_proj": nn.Linear(8, 3)})   # "sparse" in a name is fine
    dense.forward = lambda x: dense["sparse_proj"](x)
    capture(dense, (torch.randn(4, 8), torch.randint(0, 3, (4,))), loss_fn=F.cross_entropy)
    with pytest.raises(CaptureError, match="sparse=False"):
        capture(model, (torch.randint(0, 32, (4, 6)), torch.randint(0, 3, (4,))),
                loss_fn=F.cross_entropy)


class _CachesInEval(nn.Module):
    """Fills a dict on first use in eval mode, as LeViT caches its attention biases,
    and counts its calls in a plain attribute."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(8))
        self.cache = {}
        self.calls = 0
        self.seen = [torch.ones(3), torch.zeros(3)]    # compared by identity, not ==

    def forward(self, x):
        self.calls += 1
        self.seen.append(x)
        if self.training:
            return self.lin(x) + self.bias * 2
        if "b" not in self.cache:
            self.cache["b"] = self.bias * 2
        return self.lin(x) + self.cache["b"]


def test_a_trace_leaves_the_modules_python_state_as_it_was():
    model = _CachesInEval()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    seen = list(model.seen)
    capture(model, (x, y), loss_fn=F.mse_loss)
    assert model.calls == 0 and model.cache == {}
    assert len(model.seen) == 2 and all(a is b for a, b in zip(model.seen, seen))
    model.eval()
    with pytest.raises(CaptureError, match="cached on a module while it was being traced"):
        capture(model, (x,), mode="infer")
    assert model.cache == {} and model.calls == 0
    with torch.no_grad():
        model(x)                   # the user's model still runs: no FakeTensor left in its cache
    assert isinstance(model.cache["b"], torch.Tensor) and model.calls == 1


def test_error_scripted_submodule_with_trainable_parameters():
    model = nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU())), nn.Linear(8, 3))
    with pytest.raises(CaptureError, match="submodule 0 is a TorchScript module"):
        capture(model, (torch.randn(4, 8), torch.randint(0, 3, (4,))), loss_fn=F.cross_entropy)
