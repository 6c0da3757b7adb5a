"""Wall time of a plan's step against eager PyTorch, for ``%%magis --measured``.

`plan_timer` returns the ``measure`` that `OptimizeResult.fit_measured` takes:
the median per-pair ratio of a plan module's step to eager PyTorch's step on a
copy of the model, the two alternating (`timing.time_steps`). A plan's
step trains the user's model (gradients, BatchNorm statistics) and draws from
the RNG; all of it is put back after every timing, so the model is left as the
cell defined it.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..capture import eager_step, split_call
from ..runtime.module import step_of
from ..snapshot import ModelSnapshot
from ..timing import clear_grads, time_steps


def plan_timer(model: nn.Module, inputs, loss_fn: Callable | None, mode: str,
               reps: int = 7) -> Callable[[nn.Module], float]:
    """``measure(module) -> time ratio`` of the module's step to eager PyTorch's."""
    args, kwargs = split_call(inputs)
    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in tree_leaves(inputs))
    eager = copy.deepcopy(model)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(mod):
        step_of(mod)(*args, **kwargs)
        sync()

    def ref():
        eager_step(eager, inputs, loss_fn, mode)
        sync()

    def measure(mod: nn.Module) -> float:
        snap = ModelSnapshot.of(model, grads=True, rng=True, cuda=cuda)
        try:
            t = time_steps(lambda: step(mod), reps, before=clear_grads(model.parameters()),
                           ref=ref, ref_before=clear_grads(eager.parameters()))
        finally:
            snap.restore()
        return t.ratio

    return measure
