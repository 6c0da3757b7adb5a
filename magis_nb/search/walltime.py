"""Wall time of a plan's step against eager PyTorch's, measured where the model runs.

`StepTimer` times a plan module's step and eager PyTorch's step on a copy of
the model, alternating pair by pair (`timing.time_steps`): the ratio the
report shows beside the simulated one, and what `optimize` picks plans by
(Note [measured at the front door] in `search.optimize`). A plan's step
trains the user's model (gradients, BatchNorm statistics) and draws from the
RNG, and eager's step does the same to its copy; both are put back after
every timing, so the model is left as the cell defined it and the copy as
the safety net holds it.
"""
from __future__ import annotations

import copy
import time
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..capture import eager_step, split_call
from ..runtime.module import step_of
from ..snapshot import ModelSnapshot
from ..timing import PairTiming, clear_grads, time_steps

REPS = 7          # timed pairs per plan at most
MIN_REPS = 3      # ... and at least, whatever the time allowance (`pairs_for`)
WARMUP = 1        # untimed steps first: each side has run the step before (the safety net)


class StepTimer:
    """``timer(module) -> PairTiming`` of the module's step against eager's.

    ``eager``: the model copy eager's steps run on (the safety net's, so no
    third copy of the weights is made); None: a deep copy of ``model``."""

    def __init__(self, model: nn.Module, inputs, loss_fn: Callable | None, mode: str,
                 eager: nn.Module | None = None, reps: int = REPS):
        self.model, self.inputs, self.loss_fn, self.mode = model, inputs, loss_fn, mode
        self.args, self.kwargs = split_call(inputs)
        self.cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in tree_leaves(inputs))
        self.eager = copy.deepcopy(model) if eager is None else eager
        self.reps = reps
        self._eager_s: float | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def eager_seconds(self) -> float:
        """One eager step's seconds (timed once, the model and copy put back)."""
        if self._eager_s is None:
            theirs = ModelSnapshot.of(self.eager, grads=True)
            rng = ModelSnapshot.of_tensors((), (), rng=True, cuda=self.cuda)
            try:
                clear_grads(self.eager.parameters())()
                t0 = time.perf_counter()
                eager_step(self.eager, self.inputs, self.loss_fn, self.mode)
                self._sync()
                self._eager_s = time.perf_counter() - t0
            finally:
                theirs.restore()
                rng.restore()
        return self._eager_s

    def pairs_for(self, seconds: float, plans: int) -> int:
        """Pairs per plan so that timing ``plans`` plans takes about ``seconds``
        (between MIN_REPS and REPS)."""
        per_plan = seconds / max(1, plans)
        n = int(per_plan / (2 * self.eager_seconds())) - WARMUP
        return max(MIN_REPS, min(REPS, n))

    def __call__(self, module: nn.Module, reps: int | None = None) -> PairTiming:
        step = step_of(module)

        def run_plan():
            step(*self.args, **self.kwargs)
            self._sync()

        def run_eager():
            eager_step(self.eager, self.inputs, self.loss_fn, self.mode)
            self._sync()

        mine = ModelSnapshot.of(self.model, grads=True, rng=True, cuda=self.cuda)
        theirs = ModelSnapshot.of(self.eager, grads=True)
        try:
            return time_steps(run_plan, reps or self.reps, warmup=WARMUP,
                              before=clear_grads(self.model.parameters()),
                              ref=run_eager, ref_before=clear_grads(self.eager.parameters()))
        finally:
            theirs.restore()
            mine.restore()
