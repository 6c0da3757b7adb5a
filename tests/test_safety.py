"""The safety net: optimize() never returns a plan that raises or differs from eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.runtime import OptimizedModule
from magis_nb.search.safety import PlanError


def _mlp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                      nn.Linear(256, 10))
    return m, (torch.randn(64, 32), torch.randint(0, 10, (64,)))


def _break(monkeypatch, how: str, keep: str | None = None) -> None:
    """Every plan's step is wrong in one of two ways (raises, or gradients x1.5),
    except the program whose code is ``keep``."""
    step = OptimizedModule.step

    def broken(self, *a, **k):
        if self.code == keep:
            return step(self, *a, **k)
        if how == "raise":
            raise RuntimeError("view size is not compatible with input tensor's size and stride")
        loss = step(self, *a, **k)
        for p in self.model.parameters():
            p.grad.mul_(1.5)
        return loss

    monkeypatch.setattr(OptimizedModule, "step", broken)


@pytest.mark.parametrize("how", ["raise", "differ"])
def test_failing_plans_are_dropped_and_reported(monkeypatch, how):
    m, inputs = _mlp()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    kw = dict(loss_fn=F.cross_entropy, mem_budget=0.5, time_budget=5, max_states=30)
    first = magis_nb.optimize(m, inputs, verify=False, **kw)
    # every optimized plan is broken; the captured program is not
    _break(monkeypatch, how, keep=first.module_for(first.before).code)
    rng = torch.get_rng_state()
    res = magis_nb.optimize(m, inputs, **kw)
    assert torch.equal(rng, torch.get_rng_state()), "the user's RNG stream is untouched"
    assert res.failed and res.verified
    assert res.plan.state is res.before.state or res.plan.applied == "re-order only"
    assert "failed the check against eager" in res.message
    f = res.failed[0]
    assert ("raised RuntimeError" in f.reason) == (how == "raise")
    assert f.code.startswith("def step(")
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_unoptimized_program_failing_is_a_plan_error(monkeypatch):
    m, inputs = _mlp()
    _break(monkeypatch, "differ")
    with pytest.raises(PlanError, match="even the captured program"):
        magis_nb.optimize(m, inputs, loss_fn=F.cross_entropy, time_budget=3, max_states=10)


def test_verified_plan_keeps_user_grads():
    m, inputs = _mlp()
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    res = magis_nb.optimize(m, inputs, loss_fn=F.cross_entropy, mem_budget=0.5,
                            time_budget=5, max_states=30)
    assert res.verified and not res.failed
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in m.parameters())


def test_a_differing_plan_names_the_first_value_that_departs():
    from magis_nb.program import trace
    from magis_nb.runtime.codegen import compile_source
    from magis_nb.search.safety import SafetyNet

    m, inputs = _mlp()
    prog = trace(m, inputs, loss_fn=F.cross_entropy)
    net = SafetyNet(m, inputs, F.cross_entropy, "train")
    bad = prog.module()
    line = next(ln for ln in bad.code.splitlines() if "aten.gelu.default(" in ln)
    name = line.split("=")[0].strip()
    bad.code = bad.code.replace(line, line.replace("aten.gelu.default(", "aten.relu.default("))
    bad.step_fn = compile_source(bad.code)
    fail = net.check(1, "hand-broken", bad, baseline=prog.module)
    assert fail is not None and fail.reason == "differs from eager"
    assert fail.where.startswith(f"first differs at {name}: {name} = aten.relu.default("), fail.where
    assert net.check(2, "as captured", prog.module()) is None


def test_an_fp32_model_on_the_cpu_gets_no_slack():
    """On the CPU eager and the program call the same kernels: an fp32 model keeps
    the fixed tolerances (no fp64 copy is run; Note [eager's own error])."""
    from magis_nb import zoo
    from magis_nb.search.safety import SafetyNet
    case = zoo.build("mlp", "tiny")
    net = SafetyNet(case.model, case.inputs, case.loss_fn, "train")
    assert net.slack == {} and net.ref.spread() == {}
