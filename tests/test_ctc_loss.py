"""Note [CTC with fixed shapes] (capture/ctc.py): F.ctc_loss captures, with its
lengths as Python ints or as tensors, in each reduction, and trains as eager;
tensor lengths may differ from the example's at later steps."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from magis_nb.program import trace
from magis_nb.verify import Reference


def _ctc(lengths: str, reduction: str):
    def loss_fn(out, targets):
        logp = out.log_softmax(-1).transpose(0, 1)     # (frames, batch, classes)
        if lengths == "ints":                           # constants of the plan
            return F.ctc_loss(logp, targets, (logp.shape[0],) * logp.shape[1], (3, 2),
                              reduction=reduction)
        return F.ctc_loss(logp, targets, torch.full((logp.shape[1],), logp.shape[0]),
                          (targets > 0).sum(-1), reduction=reduction)
    return loss_fn


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("lengths", ["ints", "tensors"])
def test_ctc_loss_captures_and_matches_eager(lengths, reduction):
    loss_fn = _ctc(lengths, reduction)
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    x, t = torch.randn(2, 10, 4), torch.randint(1, 6, (2, 3))
    t[1, 2] = 0                                         # the second target is 2 long
    step = trace(model, (x, t), loss_fn=loss_fn).module()
    chk = Reference(model, (x, t), loss_fn, "train").check(step)
    assert chk.comparison.allclose, chk.comparison.mismatches
    if lengths == "tensors":                            # other lengths: 1 and 3
        t2 = t.clone()
        t2[0, 1:] = 0
        t2[1] = torch.tensor([4, 5, 1])
        chk = Reference(model, (x, t2), loss_fn, "train").check(step)
        assert chk.comparison.allclose, chk.comparison.mismatches
