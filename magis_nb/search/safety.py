"""The safety net: a plan is run once against eager PyTorch before it is handed out.

A plan is a program, and a program can be wrong where the simulator cannot see it
(a kernel that rejects a layout, a rule that is subtly off on a model nobody tried).
`SafetyNet.check` runs a plan's module on the real example inputs from the model's
current state and compares loss, every gradient and every buffer with one eager
step (computed once, on a deep copy, same RNG seed). A plan that raises or
differs is never returned: `optimize` drops it from the front, records a
`PlanFailure` (what failed, the generated line or the tensors that differ, the
plan's code to reproduce it) and picks the next plan. The user's model, its
gradients and the global RNG come back as they were.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..capture import split_call
from ..runtime.module import step_of
from ..snapshot import forked_rng
from ..verify import ATOL, REL_ATOL, RTOL, Reference
from .divergence import first_divergence

# fp32: the comparison's own tolerances (verify.py says why).
# Low precision (bf16/fp16 parameters or autocast): eager's own fp32-vs-bf16 spread.
LOW_RTOL, LOW_REL_ATOL = 2e-2, 2e-2


# Note [low-precision parameters]
# A model whose parameters are bf16 (or fp16) computes each gradient in that
# precision, and eager's own result is off the exact one by its rounding: on
# tiny GPT `.to(bfloat16)`, LayerNorm bias gradients are off the fp32 step's by
# up to 46% of their largest magnitude (the median gradient by 1.2%). A plan
# that splits the batch sums the parts' gradients, each rounded to bf16, and
# differs from eager by as much again; the fixed tolerances above refused every
# such plan (tiny GPT: x0[0]/2 to /12 all "differs from eager" on LayerNorm
# gradients), so a bf16 model got no fission.
# With bf16 parameters the check therefore gives each tensor SPREAD_SLACK times
# eager's own error as more atol: the largest difference between eager's step
# and the same step of an fp32 copy (`verify.Reference.spread`). A plan then
# stays within about three times eager's error of the exact step. Autocast
# models (fp32 parameters) keep the fixed tolerances on the CPU: they pass them.

# Note [eager's own error]
# On a GPU an fp32 plan and eager do not run the same kernels: eager's BatchNorm
# is cuDNN's, the captured program's is ATen's native one, and cuDNN sums some
# convolution weight gradients with atomics, in an order that changes from run
# to run. Through a BatchNorm backward those differences grow: on the first GPU
# run (H200, TF32 off) the unoptimized tiny U-Net differed from eager by
# 1.35e-05 on its first convolution's gradient and the tiny ResNet by 0.0123,
# both refused by the fixed tolerances, so `optimize` raised PlanError on a
# correct program. An fp32 model on a GPU therefore gets the same slack as a
# bf16 one, with eager's error measured against an fp64 copy.


class PlanError(RuntimeError):
    """No plan could be handed out: even the unoptimized program failed its check."""

    def __init__(self, message: str, failures: list["PlanFailure"] | None = None):
        self.failures = failures or []
        super().__init__(message)


@dataclass
class PlanFailure:
    plan: str                 # what the plan applies ("fission x0[0]/4; swap 3")
    reason: str               # "raised RuntimeError: ..." or "differs from eager: ..."
    where: str                # the generated line that raised, or the tensors that differ
    code: str                 # the plan's generated source: a reproducer

    def __str__(self) -> str:
        return f"plan [{self.plan}] {self.reason} ({self.where})"


def _generated_line(exc: BaseException) -> str:
    """The line of the generated program the exception came from."""
    for fs in reversed(traceback.extract_tb(exc.__traceback__)):
        if fs.filename.startswith("<magis_nb-generated"):
            return f"generated line {fs.lineno}: {(fs.line or '').strip()}"
    return "outside the generated program"


class SafetyNet:
    """Eager's step once; each plan's module held against it, once."""

    def __init__(self, model: nn.Module, inputs, loss_fn, mode: str, seed: int = 0,
                 low_precision: bool = False, phased: bool | None = None):
        self.model = model
        self.tol = dict(rtol=LOW_RTOL, atol=ATOL, rel_atol=LOW_REL_ATOL) if low_precision \
            else dict(rtol=RTOL, atol=ATOL, rel_atol=REL_ATOL)
        with forked_rng():
            self.ref = Reference(model, inputs, loss_fn, mode, seed, phased=phased)
            self.ref.spread()
        self.done: dict[int, PlanFailure | None] = {}
        # key -> (measured peak of the plan's step, its module's host buffers), for
        # the plans that passed: what `OptimizeResult.measured` reports
        self.measured: dict[int, tuple[int, int]] = {}

    @property
    def slack(self) -> dict[str, float]:
        """More atol per tensor in float32 (`Reference.slack`): empty for an fp32
        model on the CPU (Note [eager's own error])."""
        return self.ref.slack()

    def check(self, key: int, label: str, module: nn.Module | Callable[[], nn.Module],
              baseline: Callable[[], nn.Module] | None = None) -> PlanFailure | None:
        """None when the plan's module (or ``module()``, built only when ``key`` was
        not checked yet) gives eager's step; else why not. When it differs and
        ``baseline()`` gives the unoptimized program's module, the failure names the
        first value of the plan's program that departs from it (`search.divergence`)."""
        if key in self.done:
            return self.done[key]
        if not isinstance(module, nn.Module):
            module = module()
        grads = {p: p.grad for p in self.model.parameters()}
        try:
            with forked_rng():
                # a model normalizing by its batch: the Reference takes its
                # allowance after its second sample (Note [two samples of
                # float32's rounding] in verify.py)
                res = self.ref.check(module, **self.tol,
                                     slack=None if self.ref.phased else self.slack)
            cmp = res.comparison
            fail = None if cmp.allclose else PlanFailure(
                label, "differs from eager", "; ".join(cmp.mismatches[:4]), module.code)
            if fail is None:
                self.measured[key] = (res.measured_peak, getattr(module, "host_bytes", 0))
            if fail is not None and baseline is not None:
                first = self._first_divergence(baseline(), module)
                if first:
                    fail.where = f"first differs at {first}; then {fail.where}"
        except Exception as e:  # noqa: BLE001 - any failure of a plan is a finding
            fail = PlanFailure(label, f"raised {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                               _generated_line(e), getattr(module, "code", ""))
        finally:
            for p, g in grads.items():     # the user's gradients as they were
                p.grad = g
        self.done[key] = fail
        return fail

    def _first_divergence(self, before: nn.Module, plan: nn.Module) -> str | None:
        ref = self.ref
        args, kwargs = split_call(ref.inputs)

        def run(mod):
            ref.restore()
            torch.manual_seed(ref.seed)
            return step_of(mod)(*args, **kwargs)

        try:
            with forked_rng():
                return first_divergence(before, plan, run, rtol=self.tol["rtol"],
                                        rel_atol=self.tol["rel_atol"])
        except Exception:  # noqa: BLE001 - the search for the op is a courtesy, not the check
            return None
        finally:
            ref.restore()
