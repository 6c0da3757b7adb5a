"""optimize() leaves the user's random streams as they were, CUDA's included
(Note [the user's CUDA generator] in snapshot.py), and the planned step's
backward scales its gradients without reading the loss's gradient off a GPU
(`runtime.module.scaled`)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.runtime.module import scaled
from magis_nb.snapshot import forked_rng


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, y):
        return F.mse_loss(self.b(F.dropout(torch.relu(self.a(x)), 0.2)), y)


def _queued():
    return torch.cuda._lazy_seed_tracker.manual_seed_all_cb


def test_forked_rng_puts_back_a_queued_cuda_seed():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA has started: no seed is queued")
    torch.manual_seed(1234)                       # queued for CUDA's start
    mine = _queued()
    with forked_rng():
        torch.manual_seed(0)
        assert _queued() is not mine
    assert _queued() is mine


def test_optimize_leaves_the_users_generators_as_they_were():
    model = Drop()
    torch.manual_seed(1234)
    cpu, queued = torch.get_rng_state(), _queued()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    torch.set_rng_state(cpu)
    res = magis_nb.optimize(model, (x, y), mem_budget=0.9, time_budget=3, max_states=4)
    assert res.module is not None
    assert torch.equal(torch.get_rng_state(), cpu)
    if cuda is None:
        assert _queued() is queued
    else:
        assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda))


def test_scaled_is_exact_when_seeded_as_asked_and_linear_otherwise():
    g = [torch.randn(3, 4), None, torch.randn(5)]
    same = [t.clone() if t is not None else None for t in g]
    assert all(a is b for a, b in zip(scaled(g, torch.tensor(1.0), 1.0), g))      # CPU: untouched
    out = scaled([t.clone() if t is not None else None for t in g], torch.tensor(3.0), 1.0)
    torch.testing.assert_close(out[0], 3 * same[0], rtol=0, atol=0)
    assert out[1] is None


@pytest.mark.gpu
def test_backward_on_a_gpu_does_not_sync():
    model = Drop().cuda()
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 16, device="cuda")
    res = magis_nb.optimize(model, (x, y), mem_budget=0.9, time_budget=3, max_states=4)
    loss = res.module(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    (2 * res.module(x, y)).backward()             # the in-place scaling: exactly twice
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, 2 * w)


class _MovesItsInput(nn.Module):
    """Its first input comes on the CPU and is moved to the weights' device in
    forward, as models do with masks and lengths."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, mask, x):
        return self.lin(x) * mask.to(x.device)


@pytest.mark.gpu
def test_the_compute_device_is_the_models_not_the_first_inputs():
    model = _MovesItsInput().cuda()
    mask, x = torch.ones(8, 16), torch.randn(8, 16, device="cuda")
    loss_fn = lambda out: out.square().mean()      # noqa: E731
    res = magis_nb.optimize(model, (mask, x), loss_fn=loss_fn, mem_budget=0.9,
                            time_budget=3, max_states=4)
    res.module(mask, x).backward()
    got = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    loss_fn(model(mask, x)).backward()
    for p, w in zip(model.parameters(), got):
        torch.testing.assert_close(p.grad, w)
