"""The optimized module behind autograd: `loss = m(x, y); loss.backward()`.

Note [the step behind autograd] (runtime/module.py): the program runs forward and
backward in the call, and `loss.backward()` hands the gradients to the parameters.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.program import trace
from magis_nb.runtime.measure import measure_cpu, model_baseline


class Net(nn.Module):
    def __init__(self, d=16, bn=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, 5)
        self.bn = nn.BatchNorm1d(2 * d) if bn else nn.Identity()

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _case(bn=False, seed=0):
    torch.manual_seed(seed)
    return Net(bn=bn), torch.randn(8, 16), torch.randint(0, 5, (8,))


def _grads(m):
    return {n: p.grad.clone() if p.grad is not None else None for n, p in m.named_parameters()}


def _module(model, x, y):
    return trace(model, (x, y), loss_fn=F.cross_entropy).module()


def test_backward_delivers_eager_gradients_and_nothing_before():
    model, x, y = _case(bn=True)
    eager = copy.deepcopy(model)
    mod = _module(model, x, y)
    loss = mod(x, y)
    assert loss.requires_grad and loss.grad_fn is not None
    assert all(p.grad is None for p in model.parameters())     # nothing until backward
    # buffers update in the call, as eager's forward does
    ref = F.cross_entropy(eager(x), y)
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean)
    assert int(model.bn.num_batches_tracked) == 1
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach())
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_scaled_loss_scales_gradients_exactly():
    model, x, y = _case()
    mod = _module(model, x, y)
    mod(x, y).backward()
    once = _grads(model)
    model.zero_grad(set_to_none=True)
    (3.0 * mod(x, y)).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, 3.0 * once[n]), n


def test_accumulation_sums_and_second_backward_raises():
    model, x, y = _case()
    mod = _module(model, x, y)
    mod(x, y).backward()
    once = _grads(model)
    loss = mod(x, y)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_retain_graph_allows_a_second_backward_as_in_eager():
    model, x, y = _case()
    mod = _module(model, x, y)
    loss = mod(x, y)
    loss.backward(retain_graph=True)
    once = _grads(model)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n])


def test_hooks_see_the_gradients():
    model, x, y = _case()
    mod = _module(model, x, y)
    seen = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen.append(n))
    mod(x, y).backward()
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())


def test_step_is_the_one_call_form():
    model, x, y = _case()
    mod = _module(model, x, y)
    loss = mod.step(x, y)
    assert not loss.requires_grad
    once = _grads(model)
    model.zero_grad(set_to_none=True)
    mod(x, y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, once[n], rtol=0, atol=0)


def test_handing_over_adds_no_memory_to_the_step():
    """The gradients become p.grad as computed (no copy): the call plus backward
    peaks where the one-call step does."""
    model, x, y = _case()
    mod = _module(model, x, y)
    base = model_baseline(model, (x, y))
    one = measure_cpu(lambda: mod.step(x, y), base).peak
    model.zero_grad(set_to_none=True)

    def both():
        loss = mod(x, y)
        loss.backward()

    two = measure_cpu(both, base).peak
    assert two == one


def test_no_grad_and_eval_run_the_inference_plan_or_say_how():
    model, x, y = _case()
    mod = _module(model, x, y)
    with torch.no_grad(), pytest.raises(RuntimeError, match="mode='infer'"):
        mod(x, y)
    mod.eval()
    with pytest.raises(RuntimeError, match="eval mode"):
        mod(x, y)
    mod.train()
    inf = trace(model, (x,), mode="infer").module()
    mod.inference = inf
    assert "inference" not in dict(mod.named_children())
    with torch.no_grad():
        out = mod(x)
    torch.testing.assert_close(out, model(x))
    with pytest.raises(ValueError, match="mode='infer'"):
        mod.inference = _module(model, x, y)


def test_inputs_that_require_grad_are_refused():
    model, x, y = _case()
    mod = _module(model, x, y)
    with pytest.raises(ValueError, match="requires grad"):
        mod(x.clone().requires_grad_(), y)


# -- GradScaler: the scale seeds the program's backward -------------------------------

class Tiny(nn.Module):
    """fp16 under autocast, with a loss so small that its gradients underflow in
    fp16 unless the backward is seeded with the loss scale."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _tiny_loss(out, y):
    return 1e-8 * F.mse_loss(out.float(), y)


def _train_fp16(step, model, x, y, scaler, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=1e3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step(model)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    return losses


def _fp16_case():
    torch.manual_seed(0)
    model, x, y = Tiny(), torch.randn(8, 16), torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        mod = trace(model, (x, y), loss_fn=_tiny_loss).module()
    return model, x, y, mod


def _eager_fp16(m, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return _tiny_loss(m(x), y)


def test_grad_scaler_seeds_the_backward_like_eager_fp16():
    model, x, y, mod = _fp16_case()
    eager = copy.deepcopy(model)
    # the gradients underflow without the scale inside the backward
    mod(x, y).backward()
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.a.parameters())
    model.zero_grad(set_to_none=True)

    s1 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    want = _train_fp16(lambda m: _eager_fp16(m, x, y), eager, x, y, s1)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    mod.grad_scaler = s2
    got = _train_fp16(lambda m: mod(x, y), model, x, y, s2)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-3, atol=0)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)
    assert s1.get_scale() == s2.get_scale()


def test_grad_scaler_skips_overflowing_steps_like_eager():
    model, x, y, mod = _fp16_case()
    eager = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60)      # overflows fp16
    _train_fp16(lambda m: _eager_fp16(m, x, y), eager, x, y, s1, steps=1)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60)
    mod.grad_scaler = s2
    _train_fp16(lambda m: mod(x, y), model, x, y, s2, steps=1)
    assert s2.get_scale() == s1.get_scale() == 2.0 ** 59             # backed off once
    for p, q in zip(model.parameters(), start):
        assert torch.equal(p.detach(), q)                            # the step was skipped


def test_optimize_result_module_trains_with_backward():
    model, x, y = _case()
    eager = copy.deepcopy(model)
    res = magis_nb.optimize(model, (x, y), loss_fn=F.cross_entropy, mem_budget=0.8, time_budget=5,
                            max_states=8)
    loss = res.module(x, y)
    loss.backward()
    F.cross_entropy(eager(x), y).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_parameter_names_do_not_change_the_program_keywords():
    """The program's keywords come from the graph, not from reading its source:
    a parameter called ``..._comm_...`` or ``..._seed_...`` is just a parameter."""
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc_comm, self.rand_seed = nn.Linear(16, 8), nn.Linear(8, 5)

        def forward(self, x):
            return self.rand_seed(torch.tanh(self.enc_comm(x)))

    torch.manual_seed(0)
    model, x, y = Named(), torch.randn(8, 16), torch.randint(0, 5, (8,))
    eager = copy.deepcopy(model)
    mod = _module(model, x, y)
    assert "_comm" in mod.code.splitlines()[0] and mod.comm is None
    mod(x, y).backward()
    F.cross_entropy(eager(x), y).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
