"""Negative controls (issue 54): each check family catches a wrong result.

A check that passes a wrong result proves nothing, so every family the suite
rests on is fed a corruption it must refuse: the comparison with eager
(`verify.Reference`, and the safety net `optimize` runs on it) gets a plan whose
gradients are zeroed, 5% off either way, or off in one element; the measured
peak gets one more live tensor than the simulator planned; the dimension rules
get a wrong split axis. The same checks must pass the right results (the
unoptimized program and every plan of a short search), or a refusal would prove
nothing either.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb import zoo
from magis_nb.analysis import DGraph, apply_fission, check
from magis_nb.analysis.ftrans import FTrans
from magis_nb.analysis.dims_base import RULES, OpDims, ax, axes_of
from magis_nb.program import trace
from magis_nb.runtime import OptimizedModule
from magis_nb.runtime.codegen import compile_source
from magis_nb.search.safety import PlanError
from magis_nb.verify import Reference


class Corrupted:
    """A plan's module whose backward is wrong: ``spoil`` rewrites the gradients
    it leaves on its model's parameters. It widens with its module (Note
    [checked in float64]), so the float64 half of a check sees the same fault."""

    def __init__(self, module, spoil):
        self.module, self.spoil = module, spoil

    def step(self, *args, **kwargs):
        out = self.module.step(*args, **kwargs)
        self.spoil([p for p in self.module.model.parameters() if p.grad is not None])
        return out

    __call__ = step

    def widened(self, model):
        return Corrupted(self.module.widened(model), self.spoil)


def _zeroed(ps):
    for p in ps:
        p.grad.zero_()


def _times(k):
    def spoil(ps):
        for p in ps:
            p.grad.mul_(k)
    return spoil


def _one_element(ps):
    """The largest gradient (by magnitude) off by 0.1% of its largest entry, in
    the middle element."""
    g = max(ps, key=lambda p: p.grad.abs().max().item()).grad.view(-1)
    g[g.numel() // 2] += 1e-3 * g.abs().max()


SPOILS = {"zeroed": _zeroed, "x1.05": _times(1.05), "x0.95": _times(0.95),
          "one element": _one_element}


def conv_norm_net(norm: str):
    """Two conv blocks with biases before their norms, as people write them: the
    biases' exact gradients are zero under a training BatchNorm (issue 54)."""
    torch.manual_seed(0)
    make = {"batch": nn.BatchNorm2d, "group": lambda c: nn.GroupNorm(2, c)}[norm]
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), make(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), make(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    return model, (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))), F.cross_entropy


CASES = zoo.names("tiny") + ["conv-batchnorm", "conv-groupnorm"]


def _case(name):
    if name.startswith("conv-"):
        return conv_norm_net(name[len("conv-"):].replace("norm", ""))
    case = zoo.build(name, "tiny")
    return case.model, case.inputs, case.loss_fn


@pytest.mark.parametrize("name", CASES)
def test_the_eager_comparison_refuses_wrong_gradients(name):
    model, inputs, loss_fn = _case(name)
    prog = trace(model, inputs, loss_fn=loss_fn)
    ref = Reference(model, inputs, loss_fn, "train")
    # a model normalizing by its batch is checked in float64 too, on the CPU
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert ref.exact == has_bn
    chk = ref.check(prog.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert (chk.exact is not None) == has_bn
    for what, spoil in SPOILS.items():
        bad = ref.check(Corrupted(prog.module(), spoil))
        assert not bad.comparison.allclose, f"{what} gradients passed"
        if has_bn:      # the float64 half refuses it on its own
            assert not bad.exact.allclose, f"{what} gradients passed in float64"


def test_a_zero_gradient_gives_no_tensor_a_wide_allowance():
    """The conv biases' gradients are zero: their float32 noise over their scale
    once became every tensor's allowance (1e9); now no gradient that is not zero
    may be off by more than a tenth of its largest magnitude in float32, and by
    more than 1e-6 of it in float64."""
    model, inputs, loss_fn = conv_norm_net("batch")
    ref = Reference(model, inputs, loss_fn, "train")
    spread, slack, exact = ref.spread(), ref.slack(), ref.exact_slack()
    scale = {n: s for n, s in ref.scales().items() if n.startswith("grad ")}
    zero = {n for n, s in scale.items() if s < 1e-12}
    assert zero == {"grad 0.bias", "grad 3.bias"}
    for n, s in scale.items():
        if n not in zero:
            assert slack[n] < 0.1 * s and exact[n] < 1e-6 * s, (n, slack[n], exact[n], s)
        else:       # its own noise, and an absolute floor from the other gradients
            assert slack[n] <= 4 * spread[n] + 1e-12 and exact[n] < 1e-9, (n, slack[n])


def test_the_unoptimized_program_is_a_second_sample_of_rounding_only_when_exact():
    """Note [two samples of float32's rounding]: the captured program's float32
    error widens each tensor's allowance to PHASED_SLACK times it, once the
    program passes the float64 half; a program 5% off in its gradients is
    refused as a sample and leaves the allowance as eager's alone."""
    from magis_nb.verify import PHASED_SLACK
    model, inputs, loss_fn = _case("resnet")
    prog = trace(model, inputs, loss_fn=loss_fn)
    ref = Reference(model, inputs, loss_fn, "train")
    eager_only = ref.slack()
    assert not ref.calibrate(Corrupted(prog.module(), _times(1.05)))
    assert ref.slack() == eager_only
    assert ref.calibrate(prog.module())
    err, slack = ref._program_error, ref.slack()
    assert set(err) == set(slack) and any(v > 0 for v in err.values())
    for n, v in slack.items():
        assert v >= PHASED_SLACK * err[n] and v >= eager_only[n], n
    for what, spoil in SPOILS.items():
        assert not ref.check(Corrupted(prog.module(), spoil)).comparison.allclose, what


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "unet", "densenet", "conv-batchnorm", "gpt"])
def test_every_plan_of_a_short_search_passes(name):
    model, inputs, loss_fn = _case(name)
    res = magis_nb.optimize(model, inputs, loss_fn=loss_fn, mem_budget=0.5, max_states=12,
                            time_budget=60, verify=False)
    ref = Reference(model, inputs, loss_fn, "train")
    assert len(res.pareto) >= 2
    for plan in res.pareto:
        chk = ref.check(res.module_for(plan))
        assert chk.comparison.allclose, (plan.applied, chk.comparison.mismatches)


def test_verified_fails_for_plans_with_a_broken_backward(monkeypatch):
    """The safety net on a BatchNorm model: every plan but the captured program
    gets gradients 5% off; none of them is returned, each is a failure, and the
    captured program is. Broken everywhere, even it fails: PlanError."""
    model, inputs, loss_fn = conv_norm_net("batch")
    kw = dict(loss_fn=loss_fn, mem_budget=0.5, max_states=12, time_budget=60)
    first = magis_nb.optimize(model, inputs, verify=False, **kw)
    plain = first.module_for(first.before).code
    # the same program as the float64 half of a check runs it (`widened`)
    as_captured = {plain, plain.replace("torch.float32", "torch.float64")}
    assert first.plan.applied != first.before.applied     # a plan the net must refuse
    step = OptimizedModule.step

    def broken(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if self.code not in as_captured:
            for p in self.model.parameters():
                p.grad.mul_(1.05)
        return out

    monkeypatch.setattr(OptimizedModule, "step", broken)
    res = magis_nb.optimize(model, inputs, **kw)
    assert res.failed and all(f.reason == "differs from eager" for f in res.failed)
    assert res.verified and res.module.code == plain
    monkeypatch.setattr(OptimizedModule, "step", lambda self, *a, **k: _spoilt(step, self, a, k))
    with pytest.raises(PlanError, match="even the captured program"):
        magis_nb.optimize(model, inputs, **kw)


def _spoilt(step, self, args, kwargs):
    out = step(self, *args, **kwargs)
    for p in self.model.parameters():
        p.grad.mul_(0.95)
    return out


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_the_measured_peak_sees_one_more_live_tensor(name):
    """Measured == simulated is a check only if a tensor the simulator did not
    plan shows: a program that keeps one more 1 MiB tensor alive through the
    step measures exactly 1 MiB more; one that frees nothing measures more."""
    model, inputs, loss_fn = _case(name)
    prog = trace(model, inputs, loss_fn=loss_fn)
    ref = Reference(model, inputs, loss_fn, "train")
    sim = prog.simulate().peak
    assert ref.check(prog.module()).measured_peak == sim
    extra = prog.module()
    lines = extra.code.splitlines()
    ret = next(i for i, ln in enumerate(lines) if ln.strip().startswith("return"))
    lines.insert(ret, "    del _extra")
    lines.insert(1, "    _extra = torch.empty(2 ** 18, device=_dev)   # 1 MiB")
    extra.code = "\n".join(lines) + "\n"
    extra.step_fn = compile_source(extra.code)
    assert ref.check(extra).measured_peak == sim + 2 ** 20
    kept = prog.module()
    kept.code = "\n".join(ln for ln in kept.code.splitlines()
                          if not ln.strip().startswith("del ")) + "\n"
    kept.step_fn = compile_source(kept.code)
    assert ref.check(kept).measured_peak > sim


class SoftmaxOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), dim=0))


def test_a_wrong_split_axis_is_caught(monkeypatch):
    """A softmax over the batch spans it: with the right rules no region splits
    the batch through it. Wrong rules that let it (every dim an axis, forward and
    backward) make a region whose parts normalize over their own rows only: the
    checks accept it as a region, and the comparison with eager refuses it."""
    torch.manual_seed(0)
    model, x, t = SoftmaxOverBatch(), torch.randn(8, 16), torch.randn(8, 8)
    prog = trace(model, (x, t), loss_fn=F.mse_loss)
    g = prog.graph
    soft = next(n.id for n in g.ops if n.target == "aten._softmax.default")
    first = next(n.id for n in g.ops if n.target == "aten.addmm.default")
    region = frozenset({first, soft})

    def batch_comp(dg):
        """The D-Graph component of the input's batch dim."""
        return next(c.id for c in dg.components if c.name == "x0[0]")

    right = DGraph(g)
    comp = batch_comp(right)
    assert first in right.components[comp].axis_of
    assert soft not in right.components[comp].axis_of and check(right, region, comp, 2)

    def every_dim(node, b, ins, outs):   # wrong: the softmax's own dim is an axis too
        return OpDims(axes_of(*(ax(outs[0][d], [(j, d) for j in range(len(ins))], [(0, d)])
                                for d in range(len(outs[0])))))

    for target in ("aten._softmax.default", "aten._softmax_backward_data.default"):
        monkeypatch.setitem(RULES, target, every_dim)
    wrong = DGraph(g)
    comp = batch_comp(wrong)
    assert check(wrong, region, comp, 2) is None
    split = prog.with_graph(apply_fission(wrong, [FTrans(region, comp, 2)]))
    chk = Reference(model, (x, t), F.mse_loss, "train").check(split.module())
    assert not chk.comparison.allclose
    assert any(m.startswith("output 0") for m in chk.comparison.mismatches)
