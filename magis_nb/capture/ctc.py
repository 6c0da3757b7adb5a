"""CTC loss in a captured step: fake kernels PyTorch does not have.

Note [CTC with fixed shapes]
``F.ctc_loss`` (and ``nn.CTCLoss``) lowers to ``aten._ctc_loss``, which
PyTorch tags as having a value-dependent output shape: its second output,
``log_alpha``, is ``[batch, frames, 2 * max(target_lengths) + 1]``. Fake
tensors refuse every op with that tag, so a user's CTC loss could not be
captured at all, even written as a plan wants it: padded 2-D targets, lengths
fixed. While a capture runs:

- ``target_lengths`` as Python ints: the op's own meta kernel gives the exact
  shape (the lengths are then constants of the plan, like any Python value the
  loss closes over);
- ``target_lengths`` as a tensor: ``log_alpha`` is traced at its largest,
  ``2 * targets.size(1) + 1`` (``targets.numel()`` for 1-D targets), which every
  batch of that shape fits: the kernel checks each length against it. The real
  kernel allocates its own, so the loss and gradients are eager's; the plan
  counts ``log_alpha`` at that bound, a [batch, frames, 2S + 1] float tensor held
  from the loss to its backward;
- ``_ctc_loss_backward``'s gradient is contiguous, as the CPU and CUDA kernels
  allocate it (``full_like(log_probs, -inf, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``).

With int lengths and ``reduction="mean"``, ATen's composite ``ctc_loss`` divides
by ``at::tensor(target_lengths)``, whose data it writes directly, which a fake
tensor has not got ("its data is not allocated yet"); ``torch.ctc_loss`` is
wrapped to make that division with ``torch.tensor``, the same ops in the same
order.
"""
from __future__ import annotations

import contextlib

import torch

aten = torch.ops.aten


def _fake(fake_mode, meta: torch.Tensor, like):
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, like.fake_device)


def _ctc_exact(fake_mode, func, log_probs, *args, **kwargs):
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager
    with in_kernel_invocation_manager(fake_mode):
        out = func(log_probs, *args, **kwargs)
    return tuple(_fake(fake_mode, t, log_probs) for t in out)


def _ctc_bounded(fake_mode, func, log_probs, targets, *args, **kwargs):
    if log_probs.dim() != 3:
        return NotImplemented           # PyTorch's own refusal
    longest = targets.size(1) if targets.dim() == 2 else targets.numel()
    batch, frames = log_probs.size(1), log_probs.size(0)
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager
    with in_kernel_invocation_manager(fake_mode):
        nll = torch.empty((batch,), dtype=log_probs.dtype, device="meta")
        alpha = torch.empty((batch, frames, 2 * longest + 1), dtype=log_probs.dtype, device="meta")
    return _fake(fake_mode, nll, log_probs), _fake(fake_mode, alpha, log_probs)


def _ctc_grad(fake_mode, func, grad, log_probs, *args, **kwargs):
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager
    with in_kernel_invocation_manager(fake_mode):
        out = torch.empty(tuple(log_probs.shape), dtype=log_probs.dtype, device="meta")
    return _fake(fake_mode, out, log_probs)


_MEAN = 1               # torch.nn._reduction.get_enum("mean")


def _int_mean(orig):
    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=_MEAN,
                 zero_infinity=False):
        if reduction != _MEAN or isinstance(target_lengths, torch.Tensor):
            return orig(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                        zero_infinity)
        each = orig(log_probs, targets, input_lengths, target_lengths, blank, 0, zero_infinity)
        lengths = torch.tensor(list(target_lengths), dtype=each.dtype, device=each.device)
        return (each / lengths.clamp_min(1)).mean()
    return ctc_loss


@contextlib.contextmanager
def traceable_ctc():
    """While active, fake tensors trace ``_ctc_loss`` and its backward (Note [CTC
    with fixed shapes])."""
    from torch._subclasses import fake_impls

    table = fake_impls.op_implementations_dict
    impls = {aten._ctc_loss.default: _ctc_exact, aten._ctc_loss.Tensor: _ctc_bounded,
             aten._ctc_loss_backward.default: _ctc_grad,
             aten._ctc_loss_backward.Tensor: _ctc_grad}
    old = {op: table.get(op) for op in impls}
    orig = torch.ctc_loss
    try:
        table.update(impls)
        torch.ctc_loss = _int_mean(orig)
        yield
    finally:
        torch.ctc_loss = orig
        for op, fn in old.items():
            if fn is None:
                table.pop(op, None)
            else:
                table[op] = fn
