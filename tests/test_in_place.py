"""Activations and their gradients written into the tensor they read (Note
[elementwise ops in place] in ir/in_place.py): the same step bit for
bit, the measured peak equal to the simulated one, and only where nothing else
reads that tensor."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.ir.in_place import IN_PLACE, in_place_ops, rewrite_in_place
from magis_nb.program import trace
from magis_nb.runtime import OptimizedModule
from magis_nb.simulate.memory import simulate_memory
from magis_nb.verify import Reference

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ACTS = [nn.ReLU(), nn.SiLU(), nn.GELU(), nn.GELU("tanh"), nn.Tanh(), nn.Sigmoid(),
        nn.LeakyReLU(0.1), nn.Hardtanh(), nn.Hardswish(), nn.Hardsigmoid(), nn.Softplus()]


def _chain():
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1)]
    for act in ACTS:
        layers += [act, nn.Conv2d(8, 8, 3, padding=1)]
    # the step's peak: the last activation's backward, every saved tensor live
    return nn.Sequential(*layers, nn.ReLU())


class _Residual(nn.Module):
    """x + relu(conv(x)): the gradient of the sum reaches two readers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        h = self.a(x)
        return self.b(h + torch.relu(h))


def _peak(g, order):
    mg, ids, _ = g.memgraph()
    index = {v: i for i, v in enumerate(ids)}
    return simulate_memory(mg, [index[v] for v in order]).peak


def test_every_activation_backward_writes_in_place_and_the_step_is_the_same():
    model = _chain()
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 8, 16, 16)
    prog = trace(model, (x, y), loss_fn=F.mse_loss)
    order = prog.to_node_order(prog.program_order())
    g = prog.graph
    # every activation's but SiLU's (decomposed on the CPU), and the last ReLU's
    backward = {n.id for n in g.ops if n.target in IN_PLACE and "backward" in n.target}
    assert len(backward) == len(ACTS)
    ops = set(in_place_ops(g))
    assert backward <= ops
    # forward: where only the activation reads its input (ReLU's backward reads
    # its output), not where the backward reads it too (GELU's)
    fwd = {g.nodes[v].target for v in ops - backward}
    assert "aten.relu.default" in fwd and "aten.gelu.default" not in fwd
    g2, _ = rewrite_in_place(g)
    assert all(g2.nodes[v].target != g.nodes[v].target for v in ops)
    ref = Reference(model, (x, y), F.mse_loss, "train")
    plain = ref.check(OptimizedModule(model, prog.captured, g, order))
    ours = ref.check(OptimizedModule(model, prog.captured, g2, order))
    assert plain.comparison.allclose and ours.comparison.allclose, ours.comparison.mismatches
    assert plain.measured_peak == _peak(g, order)
    assert ours.measured_peak == _peak(g2, order) < plain.measured_peak
    # bit for bit the program it rewrites
    losses, grads = [], []
    for graph in (g, g2):
        for p in model.parameters():
            p.grad = None
        losses.append(OptimizedModule(model, prog.captured, graph, order).step(x, y))
        grads.append([p.grad.clone() for p in model.parameters()])
        ref.restore()
    assert torch.equal(*losses) and all(map(torch.equal, *grads))


def test_a_gradient_another_op_reads_is_not_written():
    model = _Residual()
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 8, 8, 8)
    prog = trace(model, (x, y), loss_fn=F.mse_loss)
    g = prog.graph
    (relu_bwd,) = [n for n in g.ops if n.target == "aten.threshold_backward.default"]
    assert len(g.readers()[g.storage_of(relu_bwd.args[0])]) > 1   # the add's gradient feeds both branches
    assert in_place_ops(g) == [] and rewrite_in_place(g) is None


def test_plans_write_in_place_and_the_unoptimized_plan_is_eagers():
    """Plans of a search run the in-place ops (priced as the kernels they
    replace, their memory the rewritten program's); the unoptimized plan is
    the program PyTorch runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
    x, y = torch.randn(8, 3, 32, 32), torch.randn(8, 2, 32, 32)
    res = magis_nb.optimize(model, (x, y), loss_fn=F.mse_loss, device_profile="rtx3090",
                            lat_budget=1.10, max_states=20)
    g0, _ = res.before.state.runs
    assert not any(n.target.endswith(".grad_input") for n in g0.ops)
    for plan in res.pareto:
        g, order = plan.state.runs
        if plan.state is res.before.state:
            continue
        assert any(n.target == "aten.threshold_backward.grad_input" for n in g.ops), plan
        assert _peak(g, order) == plan.peak
    chk = Reference(model, (x, y), F.mse_loss, "train").check(res.module)
    assert chk.comparison.allclose and chk.measured_peak == res.plan.peak
