"""Graph rewrites keep eager semantics bit for bit (see Note [dropout as a mask ...])."""
import torch
import torch.nn as nn

from magis_nb.program import trace
from magis_nb.verify import check_step


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)
        self.d = nn.Dropout(0.37)

    def forward(self, x):
        return self.d(self.l(x).t()).pow(2).mean()   # dropout of a non-contiguous tensor


def test_dropout_is_decomposed_and_bit_exact():
    m = Drop()
    x = torch.randn(128, 64)
    prog = trace(m, (x,))
    targets = [n.target for n in prog.graph.ops]
    assert "aten.native_dropout.default" not in targets
    assert targets.count("aten.bernoulli_.float") == 1
    chk = check_step(m, (x,), None, "train", lambda _: prog.module(), seed=11, rtol=0, atol=0)
    assert chk.comparison.allclose, chk.comparison.mismatches


def test_eval_dropout_is_left_alone():
    m = Drop().eval()
    prog = trace(m, (torch.randn(128, 64),), mode="infer")
    assert "aten.bernoulli_.float" not in [n.target for n in prog.graph.ops]


class Upsample(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = nn.functional.interpolate(self.c(x), scale_factor=2, mode="nearest")
        return y.to(torch.float64).pow(2).mean()


def test_metadata_asserts_are_dropped_and_the_step_is_unchanged():
    """See Note [metadata asserts]: the raw capture has them, the traced graph not."""
    from magis_nb.capture import capture
    from magis_nb.ir.build import build_graph
    m, x = Upsample(), torch.randn(4, 3, 8, 8)
    assert_op = "aten._assert_tensor_metadata.default"
    raw = [n.target for n in build_graph(capture(m, (x,), mode="train")).ops]
    assert assert_op in raw
    prog = trace(m, (x,))
    assert assert_op not in [n.target for n in prog.graph.ops]
    assert len(prog.graph.ops) == len(raw) - raw.count(assert_op)
    chk = check_step(m, (x,), None, "train", lambda _: prog.module(), rtol=0, atol=0)
    assert chk.comparison.allclose, chk.comparison.mismatches
