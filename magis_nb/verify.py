"""Hold an optimized program against eager PyTorch: loss, gradients, buffers, peak."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from .capture import eager_step, flatten, split_call
from .runtime.measure import measure_cpu, model_baseline
from .runtime.module import step_of
from .snapshot import ModelSnapshot

RTOL, ATOL = 1e-4, 1e-5


@dataclass
class Comparison:
    allclose: bool
    max_abs_err: float
    mismatches: list[str] = field(default_factory=list)


def _close(name, a, b, rtol, atol, out: Comparison, rel_atol: float = 0.0):
    if a is None or b is None:
        if (a is None) != (b is None):
            out.allclose = False
            out.mismatches.append(f"{name}: one side is None")
        return
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        out.allclose = False
        out.mismatches.append(f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        return
    err = (a - b).abs().max().item() if a.numel() else 0.0
    out.max_abs_err = max(out.max_abs_err, err)
    if rel_atol and a.numel():
        atol = atol + rel_atol * a.abs().max().item()
    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        out.allclose = False
        out.mismatches.append(f"{name}: max abs err {err:.3g}")


def compare_models(ref: nn.Module, got: nn.Module, ref_out, got_out, *,
                   rtol=RTOL, atol=ATOL, rel_atol: float = 0.0) -> Comparison:
    """Outputs (or loss), every .grad and every buffer of two copies of a model.

    ``rel_atol`` adds that fraction of each reference tensor's largest magnitude
    to ``atol``: low-precision (bf16) results are close relative to their scale,
    and elements near zero carry the scale's rounding error, not their own."""
    cmp = Comparison(True, 0.0)
    ra, _ = flatten(ref_out)
    ga, _ = flatten(got_out)
    if len(ra) != len(ga):
        return Comparison(False, float("inf"), ["different number of outputs"])
    for i, (a, b) in enumerate(zip(ra, ga)):
        _close(f"output {i}", a, b, rtol, atol, cmp, rel_atol)
    for (n, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        _close(f"grad {n}", p.grad, q.grad, rtol, atol, cmp, rel_atol)
    for (n, b), (_, c) in zip(ref.named_buffers(), got.named_buffers()):
        _close(f"buffer {n}", b, c, rtol, atol, cmp, rel_atol)
    return cmp


@dataclass
class StepCheck:
    comparison: Comparison
    measured_peak: int
    baseline: int
    eager_peak: int


class Reference:
    """Eager PyTorch's result for one step, computed once, to hold many plans against.

    Every ``check`` starts from the model's state at construction (parameters,
    buffers, no grads) and puts it back afterwards.
    """

    def __init__(self, model: nn.Module, inputs: tuple, loss_fn, mode: str, seed: int = 0):
        self.model, self.inputs, self.loss_fn, self.mode, self.seed = model, inputs, loss_fn, mode, seed
        self.start = ModelSnapshot.of(model)
        self.ref = copy.deepcopy(model)
        for p in self.ref.parameters():
            p.grad = None
        torch.manual_seed(seed)
        m = measure_cpu(lambda: eager_step(self.ref, inputs, loss_fn, mode),
                        model_baseline(self.ref, inputs))
        self.out, self.eager_peak = m.result, m.peak

    def restore(self) -> None:
        """The model back to its state at construction, without gradients."""
        self.start.restore()

    def check(self, runner: Callable, *, rtol=RTOL, atol=ATOL, rel_atol: float = 0.0) -> StepCheck:
        self.restore()
        torch.manual_seed(self.seed)
        args, kwargs = split_call(self.inputs)
        # what the runner keeps between steps (an OptimizedModule's lifted constants)
        own = runner.resident() if hasattr(runner, "resident") else []
        try:
            step = step_of(runner)
            ours = measure_cpu(lambda: step(*args, **kwargs),
                               model_baseline(self.model, self.inputs) + own)
            cmp = compare_models(self.ref, self.model, self.out, ours.result, rtol=rtol,
                                 atol=atol, rel_atol=rel_atol)
        finally:
            self.restore()
        return StepCheck(cmp, ours.peak, ours.baseline, self.eager_peak)


def check_step(model: nn.Module, inputs: tuple, loss_fn, mode: str,
               make_runner: Callable[[nn.Module], Callable], *, seed: int = 0,
               rtol=RTOL, atol=ATOL) -> StepCheck:
    """One plan against eager (see ``Reference``): eager runs on a deep copy,
    ``make_runner(model)`` on ``model``, both from the same state and RNG seed;
    ``model`` is put back as it was afterwards."""
    return Reference(model, inputs, loss_fn, mode, seed).check(make_runner(model),
                                                               rtol=rtol, atol=atol)
