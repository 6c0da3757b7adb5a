"""ModelSnapshot: what it saves comes back exactly, as often as it is restored."""
import copy

import torch
from torch import nn

from magis_nb.snapshot import ModelSnapshot


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))


def _step(m):
    m(torch.randn(8, 4)).sum().backward()


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_parameters_buffers_grads_and_rng_come_back():
    m = _model()
    _step(m)
    before, grads = _state(m), [p.grad.clone() for p in m.parameters()]
    snap = ModelSnapshot.of(m, grads=True, rng=True)
    draw = torch.rand(3)
    for _ in range(2):                      # restored twice: the second is as exact
        _step(m)
        with torch.no_grad():
            m[0].weight.add_(1.0)
        snap.restore()
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads))
        assert torch.equal(torch.rand(3), draw)


def test_without_grads_restore_clears_them():
    m = _model()
    snap = ModelSnapshot.of(m)
    _step(m)
    snap.restore()
    assert all(p.grad is None for p in m.parameters())
    assert m[1].num_batches_tracked.item() == 0


def test_restore_into_a_deep_copy():
    m = _model()
    snap = ModelSnapshot.of(m)
    twin = copy.deepcopy(m)
    _step(twin)
    snap.restore(into=twin)
    assert all(torch.equal(v, w) for v, w in zip(twin.state_dict().values(), m.state_dict().values()))
    assert all(p.grad is None for p in twin.parameters())


def test_buffers_only_leave_parameters_and_grads_alone():
    m = _model()
    snap = ModelSnapshot.buffers_of(m)
    _step(m)
    grad = m[0].weight.grad.clone()
    with torch.no_grad():
        m[0].weight.add_(1.0)
    w = m[0].weight.detach().clone()
    snap.restore()
    assert m[1].running_mean.abs().sum().item() == 0 and m[1].num_batches_tracked.item() == 0
    assert torch.equal(m[0].weight, w) and torch.equal(m[0].weight.grad, grad)


def test_of_tensors_restores_those_tensors():
    m = _model()
    params, buffers = list(m.parameters()), list(m.buffers())
    before = [t.detach().clone() for t in params + buffers]
    snap = ModelSnapshot.of_tensors(params + buffers, params)
    _step(m)
    with torch.no_grad():
        params[0].add_(1.0)
    snap.restore()
    assert all(torch.equal(t, b) for t, b in zip(params + buffers, before))
    assert all(p.grad is None for p in params)
