"""Cross-entropy spelled as the ATen ops F.cross_entropy decomposes into.

Note [meta nll_loss]: in torch 2.13, `aot_export_module(trace_joint=True)` on meta
tensors loses autograd through `aten::nll_loss` (a CompositeImplicitAutograd op that
also has a Python Meta kernel, which the python dispatcher picks instead of the
decomposition), so every parameter "did not receive a gradient". Calling
`log_softmax` + `nll_loss_forward` / `nll_loss2d_forward` directly gives the same
joint graph as F.cross_entropy on CPU/CUDA and also traces on meta.
"""
from __future__ import annotations

import torch

_MEAN = 1  # at::Reduction::Mean


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over classes in dim 1, like F.cross_entropy([N,C] or [N,C,H,W])."""
    logp = torch.log_softmax(logits, 1)
    if logp.dim() == 2:
        return torch.ops.aten.nll_loss_forward(logp, target, None, _MEAN, ignore_index)[0]
    if logp.dim() == 4:
        return torch.ops.aten.nll_loss2d_forward(logp, target, None, _MEAN, ignore_index)[0]
    raise ValueError(f"cross_entropy: expected 2-D or 4-D logits, got {logp.dim()}-D")
