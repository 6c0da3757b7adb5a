"""magis_nb.kernels: the program's faster op substitutes equal ATen's ops bit for bit."""
import pytest
import torch
import torch.nn as nn

from magis_nb.ir.graph import Node
from magis_nb.program import trace
from magis_nb.kernels import callable_for, dropout_apply
from magis_nb.simulate.measured import MeasuredCost
from magis_nb.verify import check_step

aten = torch.ops.aten


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64,
                   torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(48, 4, 16, 16), (7, 13), (5,)])
def test_dropout_apply_is_bit_identical(dtype, shape):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g).to(dtype)
    x.view(-1)[:3] = torch.tensor([-0.0, float("inf"), float("nan")], dtype=dtype)
    mask = torch.rand(shape, generator=g) < 0.8
    mask.view(-1)[:3] = False        # -0 * 0, inf * 0 and nan * 0: signs and NaNs kept
    for scale in (1 / 0.9, 1 / 0.63, 0.0):
        ref = aten.native_dropout_backward.default(x, mask, scale)
        out = dropout_apply(x, mask, scale)
        assert out.dtype == ref.dtype and out.shape == ref.shape and out.stride() == ref.stride()
        assert torch.equal(_bits(out), _bits(ref))


def test_dropout_apply_falls_back_on_strided_inputs():
    x = torch.randn(16, 8).t()
    mask = torch.rand(16, 8).t() < 0.5
    ref = aten.native_dropout_backward.default(x, mask, 2.0)
    out = dropout_apply(x, mask, 2.0)
    assert out.stride() == ref.stride() and torch.equal(out, ref)


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)
        self.d = nn.Dropout(0.25)

    def forward(self, x):
        return self.d(torch.tanh(self.l(x))).pow(2).mean()


def test_program_applies_masks_through_the_substitute_and_matches_eager_exactly():
    m = Drop()
    x = torch.randn(128, 64)
    prog = trace(m, (x,))
    code = prog.module().code
    assert code.count("_dropout_apply(") == 2        # the forward and the backward
    assert "aten.native_dropout_backward" not in code
    chk = check_step(m, (x,), None, "train", lambda _: prog.module(), seed=5, rtol=0, atol=0, rel_atol=0)
    assert chk.comparison.allclose, chk.comparison.mismatches


def test_measured_cost_times_the_substitute_under_its_own_key(tmp_path):
    m = Drop()
    prog = trace(m, (torch.randn(128, 64),))
    cost = MeasuredCost("cpu", cache_dir=tmp_path, reps=1)
    nodes = [n for n in prog.graph.ops if n.target == "aten.native_dropout_backward.default"]
    assert nodes
    for n in nodes:
        assert isinstance(n, Node)
        assert ":_dropout_apply" in MeasuredCost.signature(prog.graph, n)
        assert callable_for(n.target, n.op) is dropout_apply
    cost.measure(prog.graph, [n.id for n in nodes])
    keys = [MeasuredCost.signature(prog.graph, n) for n in nodes]
    assert all(cost.table[k] is not None and cost.table[k] > 0 for k in keys)
