"""Faster ways to run some ATen ops, with bit-identical results.

The generated program (`runtime/codegen.py`) calls these instead of the op a
node names, and the measured cost model (`simulate/measured.py`) times them the
same way (`callable_for`), so a plan is priced as it runs. Both read this
module, which imports nothing of magis_nb's.

Note [applying a dropout mask]
The program draws dropout masks as bool tensors (see Note [dropout as a mask
plus an elementwise op] in ir/passes.py) and applies them with
``native_dropout_backward(x, mask, scale)``, i.e. ``x * mask * scale``. On the
CPU, ATen casts the bool mask to x's dtype through a slow scalar conversion
loop before the multiply, and allocates an intermediate for each product: at
BERT tiny's attention shape (48x4x128x128) it took 2.9 ms where eager's
``x * noise`` (a float mask) took 0.44 ms, and the 26 calls per training step
cost the program about 6% of its step against eager. The same bytes read as
uint8 convert through the vectorized path; multiplying in place then costs one
allocation, the output. ``mask * x`` and ``x * mask`` are the same IEEE
products, so the result equals ATen's bit for bit (signed zeros included:
tests/test_kernels.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

aten = torch.ops.aten


def dropout_apply(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``native_dropout_backward(x, mask, scale)``, faster on the CPU (see the Note)."""
    if (torch.compiler.is_compiling() or x.device.type != "cpu" or mask.dtype != torch.bool
            or not x.is_floating_point() or x.shape != mask.shape or not x.is_contiguous()
            or not mask.is_contiguous()):
        # ATen's own op elsewhere: inductor fuses it into its neighbours' kernel
        # (the uint8 view would leave it a slow scalar loop there: BERT at the
        # bench size, x1.56 of compiled PyTorch), CUDA's kernel is fused, and
        # broadcast or strided inputs lay out their output by TensorIterator's rules
        return aten.native_dropout_backward.default(x, mask, scale)
    return mask.view(torch.uint8).to(x.dtype).mul_(x).mul_(scale)


# op target -> (the name the generated program calls it by, the function)
SUBSTITUTES: dict[str, tuple[str, Callable]] = {
    "aten.native_dropout_backward.default": ("_dropout_apply", dropout_apply),
}


def substitute(target: str, name: str, fn: Callable, op: Callable) -> None:
    """Run ``fn`` for nodes with this target. magis_nb's own ops
    (``torch.ops.magis_nb.*``: BatchNorm's phases, causal masks) register
    their Python implementations here: called through the dispatcher, a
    Python kernel costs about 120 us more per call on this CPU (``bn_elemt``
    on [8, 16, 64, 64]: 172 us through ``torch.ops``, 53 us called directly),
    a twentieth of a tiny U-Net's step at 18 BatchNorms.

    Under a TorchDispatchMode (the CPU memory tracker) or torch.compile the op
    runs through ``op`` instead: the mode then sees one op and its outputs, as it does for
    an ATen kernel, not the small per-channel temporaries inside it, which
    the memory model does not count either."""
    def run(*args, **kwargs):
        # compiled (a plan under torch.compile), the op is what dynamo traces
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            return op(*args, **kwargs)
        return fn(*args, **kwargs)

    run.__name__ = name
    SUBSTITUTES[target] = (name, run)


def callable_for(target: str, op: Callable) -> Callable:
    """What the program runs for a node with this target."""
    sub = SUBSTITUTES.get(target)
    return op if sub is None else sub[1]


def namespace() -> dict[str, Callable]:
    """The substitutes by their names in generated code."""
    return {name: fn for name, fn in SUBSTITUTES.values()}
