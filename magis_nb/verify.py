"""Hold an optimized program against eager PyTorch: loss, gradients, buffers, peak."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .capture import eager_step, flatten, split_call
from .draws import RecordDraws, ReplayDraws
from .runtime.measure import measure_cpu, model_baseline
from .runtime.module import step_of
from .snapshot import ModelSnapshot

# fp32: rtol, atol, and more atol of this fraction of each reference tensor's
# largest magnitude (a fission or a re-ordered reduction adds in another order;
# elements near zero carry the scale's rounding, not their own). The checks
# used a plain atol of 1e-5, which let the largest gradient of the tiny MLP, GPT
# and BTLM be off by 0.1% of its largest entry in one element (issue 54).
RTOL, ATOL, REL_ATOL = 1e-4, 1e-6, 1e-5


@dataclass
class Comparison:
    allclose: bool
    max_abs_err: float
    mismatches: list[str] = field(default_factory=list)


def _close(name, a, b, rtol, atol, out: Comparison, rel_atol: float = 0.0,
           slack: dict[str, float] | None = None):
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
    if slack:
        atol = atol + slack.get(name, 0.0)
    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        out.allclose = False
        out.mismatches.append(f"{name}: max abs err {err:.3g}")


def compare_models(ref: nn.Module, got: nn.Module, ref_out, got_out, *,
                   rtol=RTOL, atol=ATOL, rel_atol: float = REL_ATOL,
                   slack: dict[str, float] | None = None) -> Comparison:
    """Outputs (or loss), every .grad and every buffer of two copies of a model.

    ``rel_atol`` adds that fraction of each reference tensor's largest magnitude
    to ``atol``: low-precision (bf16) results are close relative to their scale,
    and elements near zero carry the scale's rounding error, not their own.
    ``slack``: more ``atol`` per tensor, by name ("output 0", "grad w",
    "buffer b"; see `Reference.spread`)."""
    cmp = Comparison(True, 0.0)
    ra, _ = flatten(ref_out)
    ga, _ = flatten(got_out)
    if len(ra) != len(ga):
        return Comparison(False, float("inf"), ["different number of outputs"])
    for name, a, b in _pairs(ref, got, ra, ga):
        _close(name, a, b, rtol, atol, cmp, rel_atol, slack)
    return cmp


def _pairs(ref: nn.Module, got: nn.Module, ra, ga):
    """(name, reference tensor, other tensor) for every output, gradient and buffer."""
    for i, (a, b) in enumerate(zip(ra, ga)):
        yield f"output {i}", a, b
    for (n, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        yield f"grad {n}", p.grad, q.grad
    for (n, b), (_, c) in zip(ref.named_buffers(), got.named_buffers()):
        yield f"buffer {n}", b, c


# A plan may differ from eager by this many times eager's own error on each tensor
# (`Reference.spread`; Note [low-precision parameters] in search/safety.py) ...
SPREAD_SLACK = 2.0
# ... and an fp32 model normalizing by its batch by this many in float32 (Note
# [phased BatchNorm's rounding]) ...
PHASED_SLACK = 4.0
# ... where a tensor at most ZERO_FLOOR of its kind's largest magnitude counts as
# zero: its exact value is (near) zero and its float32 values are the rounding of
# the sums that cancel there (a conv bias before a training BatchNorm).
ZERO_FLOOR = 1e-6
# Float64 (Note [checked in float64]): rtol, and more atol per tensor of
# EXACT_REL times its largest magnitude (floored at ZERO_FLOOR of its kind's) or
# EXACT_SLACK times eager's float32 error scaled to float64's rounding, if larger.
EXACT_RTOL, EXACT_REL, EXACT_SLACK = 1e-7, 1e-7, 16.0
_ROUNDING_64_32 = 2.0 ** -29         # float64's unit roundoff over float32's


# Note [phased BatchNorm's rounding]
# The program computes a training BatchNorm in phases (Note [BatchNorm in phases]
# in ir/phased_norm.py): op by op as exact as ATen's kernels (within an ulp of an
# fp64 step, as they are: tests/test_phased_norm.py), but not bit for bit theirs.
# Tiny conv nets amplify an ulp through every BatchNorm backward: eager's own fp32
# gradients differ from fp64's by up to 2% of a tensor's largest magnitude (tiny
# U-Net and ResNet), and the program's, equally exact in the median (0.11% vs
# 0.30% on the tiny U-Net), lands up to 4.6 times farther on single tensors
# (down.3.1.3.weight, whose largest gradient is 3e-5). A difference of rounding
# is no smaller than the rounding, so in float32 such a model's checks give each
# tensor PHASED_SLACK times eager's error against an fp64 copy as more atol,
# floored at eager's worst relative error on any tensor of its kind (gradients,
# buffers, outputs) times the tensor's own largest magnitude: eager's error on
# one tensor can be far below the model's level by luck (a base-8 U-Net at batch
# 1, 256 px: 2e-6 on down.0.1.3.weight, where the program is 0.6% off).
# The level is taken over the tensors that are not zero (ZERO_FLOOR): a conv
# bias feeding a training BatchNorm has an exactly zero gradient, about 1e-17 in
# fp64 and float32 noise of 1e-9, and its noise over its scale once made the
# level 1e9, so zeroed gradients passed (issue 54). A zero tensor keeps its own
# allowance, PHASED_SLACK times eager's error on it.
# Such an allowance is wide (up to 8% of a gradient's largest magnitude on the
# tiny U-Net: a gradient 5% off passes), so it is only the float32 half of the
# check: Note [checked in float64] is the half that can fail.

# Note [two samples of float32's rounding]
# Eager's float32 step is one sample of how rounding moves this model's results;
# where it is amplified (a training BatchNorm and a ReLU after it: an element a
# few ulps from zero passes its gradient in one rounding and not in another),
# one sample is luck. The tiny DenseNet on an AMD EPYC: eager's gradient of
# transitions.1.2.weight is 0.3% of its scale off fp64's, the captured program's
# 12% (its threshold_backward passes an element eager's does not; every op of
# the program is within 1e-5 of fp64 given the same inputs), while the program
# equals eager to 3e-14 in float64. So the captured program, unoptimized, is a
# second sample (`Reference.calibrate`, taken from the first OptimizedModule
# checked): each tensor's error is the larger of the two, and the model-wide
# level of Note [phased BatchNorm's rounding] is taken over both. It is taken
# only once the program passes the float64 half, so what it adds is rounding;
# the unoptimized program's own float32 half then passes by construction, and
# its float64 half is its check (tests/test_checks_fail.py).

# Note [checked in float64]
# Where float32 rounding is amplified (a model normalizing by its batch, on the
# CPU), a plan is also held against eager in float64, both sides: `Reference`
# keeps a float64 copy of the model and eager's float64 step, and runs the same
# plan widened (`OptimizedModule.widened`: its program with float64 for float32)
# on that copy. Rounding then sits about 2**29 below float32's, so a plan may
# differ from eager's float64 step by rtol EXACT_RTOL plus, per tensor, the
# larger of EXACT_REL of its largest magnitude (floored at ZERO_FLOOR of its
# kind's: a zero gradient gets an absolute allowance from its kind, never a
# relative one of its own noise) and EXACT_SLACK times eager's float32 error on
# it scaled by 2**-29 (eager's own error, as float64 rounds). A wrong gradient
# 5%, 0.1% or one element off then fails on every BatchNorm model of the zoo
# (tests/test_checks_fail.py). The float32 step still runs: it is the one the
# user gets (its peak is the one measured, a layout a kernel refuses raises
# there), with the allowance of Note [phased BatchNorm's rounding].


def _wider(params: list[torch.Tensor], buffers: list[torch.Tensor],
           phased: bool = False) -> torch.dtype | None:
    """The dtype eager's own error is measured against (`Reference.spread`): fp32
    for a model holding bf16/fp16 parameters or buffers; fp64 for an fp32 model on
    a GPU, whose kernels (cuDNN's BatchNorm in eager, the captured program's native
    one; convolution weight gradients summed with atomics) differ from run to run
    and from the program's, and for an fp32 model normalizing by its batch
    (``phased``: BatchNorm training, InstanceNorm), which the program computes in
    phases with its own rounding (Note [BatchNorm in phases] in
    ir/phased_norm.py); else None (on the CPU the program and eager
    call the same kernels)."""
    ts = params + buffers
    if any(t.dtype in (torch.bfloat16, torch.float16) for t in ts):
        return torch.float32
    if any(t.dtype == torch.float32 and (t.device.type == "cuda" or phased) for t in ts):
        return torch.float64
    return None


def normalizes_by_batch(model: nn.Module, mode: str) -> bool:
    """Whether a step of ``model`` normalizes with statistics of its input
    (a BatchNorm training, or without running statistics; an InstanceNorm):
    the program computes those in phases (Note [BatchNorm in phases])."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) \
                and ((m.training and mode == "train") or m.running_mean is None):
            return True
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) \
                and (m.training or not m.track_running_stats):
            return True
    return False


def _room_for_wide_copy(params: list[torch.Tensor], peak: int) -> bool:
    """On a GPU, whether a copy of the model twice as wide (fp32 of bf16, fp64 of
    fp32: its weights and gradients, twice the size) and its step fit beside what
    is there; elsewhere True."""
    cuda = [p for p in params if p.device.type == "cuda"]
    if not cuda:
        return True
    free, _ = torch.cuda.mem_get_info(cuda[0].device)
    return free > 4 * sum(p.numel() * p.element_size() for p in params) + 2 * peak


@dataclass
class StepCheck:
    comparison: Comparison          # both halves: float32, and float64 where it ran
    measured_peak: int
    baseline: int
    eager_peak: int
    exact: Comparison | None = None  # the float64 half (Note [checked in float64])


@dataclass
class _WideStep:
    """Eager's step in a wider dtype, and a fresh wide copy to run plans on."""
    model: nn.Module                # the copy plans run on, put back by ``start``
    start: ModelSnapshot
    ref: nn.Module                  # the copy eager's wide step ran on: its grads, buffers
    inputs: tuple
    out: object


def widen(runner, model: nn.Module):
    """``runner`` as it runs on ``model``, a float64 copy of its model: an
    `OptimizedModule`'s `widened`, or any runner's own ``widened(model)``
    method. A runner that cannot (a plain callable) raises TypeError: on a model
    checked in float64 a float32-only check cannot fail (Note [checked in
    float64])."""
    if hasattr(runner, "widened"):
        return runner.widened(model)
    raise TypeError(f"{type(runner).__name__} cannot run in float64: this model normalizes "
                    "by its batch and is checked in float64 (Note [checked in float64]); "
                    "pass an OptimizedModule or a runner with a widened(model) method")


def _kind(name: str) -> str:
    return name.split(" ", 1)[0]     # "grad", "buffer", "output"


def _kind_scales(scale: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, v in scale.items():
        out[_kind(n)] = max(out.get(_kind(n), 0.0), v)
    return out


class Reference:
    """Eager PyTorch's result for one step, computed once, to hold many plans against.

    Every ``check`` starts from the model's state at construction (parameters,
    buffers, no grads) and puts it back afterwards.
    """

    def __init__(self, model: nn.Module, inputs: tuple, loss_fn, mode: str, seed: int = 0,
                 phased: bool | None = None, replay_draws: bool | None = None):
        """``phased``: the program computes normalizations in phases (Note
        [phased BatchNorm's rounding]); None: guessed from the model's norms.
        ``replay_draws``: the wide step draws what eager's float32 step drew
        (Note [the wide step draws eager's masks] in draws.py); None: where the
        model is on CUDA."""
        self.model, self.inputs, self.loss_fn, self.mode, self.seed = model, inputs, loss_fn, mode, seed
        self.replay_draws = replay_draws
        self.phased = normalizes_by_batch(model, mode) if phased is None else phased
        self.start = ModelSnapshot.of(model)
        self.ref = copy.deepcopy(model)
        for p in self.ref.parameters():
            p.grad = None
        torch.manual_seed(seed)
        m = measure_cpu(lambda: eager_step(self.ref, inputs, loss_fn, mode),
                        model_baseline(self.ref, inputs))
        self.out, self.eager_peak = m.result, m.peak
        self._wide: _WideStep | None | bool = False     # False: not tried yet
        self._spread: dict[str, float] | None = None
        self._scale: dict[str, float] = {}      # each tensor's largest magnitude (wide step)
        # the captured program's own float32 error per tensor (`calibrate`);
        # None: not calibrated yet
        self._program_error: dict[str, float] | None = None

    def _wide_step(self) -> _WideStep | None:
        """Eager's step on a copy of the model in the dtype `_wider` names
        (parameters, buffers and floating inputs; the same RNG seed), once; None
        when no wider dtype applies, the wide step fails, or a GPU has no room."""
        if self._wide is False:
            self._wide = None
            params = list(self.ref.parameters())
            wide_t = _wider(params, list(self.ref.buffers()), self.phased)
            if wide_t is not None and _room_for_wide_copy(params, self.eager_peak):
                self.restore()
                try:
                    model = copy.deepcopy(self.model).to(wide_t)
                finally:
                    self.restore()
                for p in model.parameters():
                    p.grad = None
                ref = copy.deepcopy(model)
                inputs = tree_map(lambda t: t.to(wide_t) if isinstance(t, torch.Tensor)
                                  and t.is_floating_point()
                                  and t.element_size() < wide_t.itemsize else t, self.inputs)
                replay = contextlib.nullcontext()
                if self._replays(params):
                    replay = ReplayDraws(self._draws())
                torch.manual_seed(self.seed)
                try:
                    with replay:
                        out = eager_step(ref, inputs, self.loss_fn, self.mode)
                    if isinstance(replay, ReplayDraws):
                        replay.finish()
                except Exception:  # noqa: BLE001 - no wide step, no spread: the plain tolerance
                    return None
                self._wide = _WideStep(model, ModelSnapshot.of(model), ref, inputs, out)
        return self._wide

    def _replays(self, params) -> bool:
        if self.replay_draws is not None:
            return self.replay_draws
        return any(p.device.type == "cuda" for p in params)

    def _draws(self) -> list:
        """Eager's float32 step once more, on a fresh copy, its draws recorded."""
        self.restore()
        try:
            model = copy.deepcopy(self.model)
        finally:
            self.restore()
        for p in model.parameters():
            p.grad = None
        rec = RecordDraws()
        torch.manual_seed(self.seed)
        with rec:
            eager_step(model, self.inputs, self.loss_fn, self.mode)
        return rec.draws

    def spread(self) -> dict[str, float]:
        """Eager's own error, per tensor: the largest difference between this
        step and the same step of a wider copy of the model (`_wide_step`): what
        a plan may add to eager's error (Note [eager's own error] in
        search/safety.py). Empty when no wider dtype applies (an fp32 model on
        the CPU), when the wide step fails, or on a GPU without room for it."""
        if self._spread is None:
            self._spread = {}
            w = self._wide_step()
            if w is None:
                return self._spread
            ra, _ = flatten(self.out)
            wa, _ = flatten(w.out)
            for name, a, b in _pairs(self.ref, w.ref, ra, wa):
                if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
                        and a.shape == b.shape and a.numel():
                    self._spread[name] = (a.detach().double() - b.detach().double()).abs().max().item()
                    self._scale[name] = b.detach().double().abs().max().item()
        return self._spread

    def scales(self) -> dict[str, float]:
        """Each tensor's largest magnitude in eager's wide step (`spread`'s
        tensors; empty where it is)."""
        self.spread()
        return dict(self._scale)

    @property
    def exact(self) -> bool:
        """Whether plans are also held against eager in float64 (Note [checked in
        float64]): an fp32 model normalizing by its batch, on the CPU, whose
        float64 step ran."""
        if not self.phased or any(p.device.type != "cpu" for p in self.ref.parameters()):
            return False
        w = self._wide_step()
        return w is not None and all(p.dtype == torch.float64 for p in w.model.parameters()
                                     if p.is_floating_point())

    def restore(self) -> None:
        """The model back to its state at construction, without gradients."""
        self.start.restore()

    def slack(self) -> dict[str, float]:
        """More atol per tensor for a plan in float32: a multiple of eager's own
        error (empty where `spread` is)."""
        k = PHASED_SLACK if self.phased else SPREAD_SLACK
        spread = self.spread()
        if not self.phased:
            return {name: k * v for name, v in spread.items()}
        # Note [two samples of float32's rounding]
        spread = {n: max(v, (self._program_error or {}).get(n, 0.0)) for n, v in spread.items()}
        # Note [phased BatchNorm's rounding]: eager's worst relative error on
        # any tensor of a kind that is not zero is the model's rounding level
        # there; a tensor eager happens to get almost exactly right gets no less
        # than that level of its scale
        top = _kind_scales(self._scale)
        level: dict[str, float] = {}
        for n, v in spread.items():
            sc = self._scale.get(n, 0.0)
            if sc > ZERO_FLOOR * top.get(_kind(n), 0.0):
                level[_kind(n)] = max(level.get(_kind(n), 0.0), v / sc)
        return {n: k * max(v, level.get(_kind(n), 0.0) * self._scale.get(n, 0.0))
                for n, v in spread.items()}

    def exact_slack(self) -> dict[str, float]:
        """More atol per tensor for a plan in float64 (Note [checked in float64])."""
        spread = self.spread()
        top = _kind_scales(self._scale)
        return {n: max(EXACT_REL * max(sc, ZERO_FLOOR * top.get(_kind(n), 0.0)),
                       EXACT_SLACK * _ROUNDING_64_32 * spread.get(n, 0.0))
                for n, sc in self._scale.items()}

    def _run(self, runner, model: nn.Module, inputs, restore: Callable[[], None]):
        restore()
        torch.manual_seed(self.seed)
        args, kwargs = split_call(inputs)
        # what the runner keeps between steps (an OptimizedModule's lifted constants)
        own = runner.resident() if hasattr(runner, "resident") else []
        try:
            step = step_of(runner)
            return measure_cpu(lambda: step(*args, **kwargs), model_baseline(model, inputs) + own)
        except BaseException:
            restore()
            raise

    def check(self, runner: Callable, *, rtol=RTOL, atol=ATOL, rel_atol: float = REL_ATOL,
              slack: dict[str, float] | None = None) -> StepCheck:
        """``runner``'s step against eager's. ``slack``: more atol per tensor in
        float32; by default `slack()` for a model normalizing by its batch, else
        none. Where `exact`, the same plan widened (`widen`) is also held against
        eager's float64 step (Note [checked in float64]); both must pass."""
        if slack is None and self.phased:
            if self._program_error is None and hasattr(runner, "captured"):
                self.calibrate(_unoptimized(runner))
            slack = self.slack()
        ours = self._run(runner, self.model, self.inputs, self.restore)
        try:
            cmp = compare_models(self.ref, self.model, self.out, ours.result, rtol=rtol,
                                 atol=atol, rel_atol=rel_atol, slack=slack)
        finally:
            self.restore()
        exact = None
        if self.exact:
            w = self._wide_step()
            try:
                wide = widen(runner, w.model)
            except ValueError:      # a program in low precision: float32's check alone
                wide = None
            if wide is not None:
                exact = self._check_wide(wide, w)
                cmp = Comparison(cmp.allclose and exact.allclose, cmp.max_abs_err,
                                 cmp.mismatches + [f"float64 {m}" for m in exact.mismatches])
        return StepCheck(cmp, ours.peak, ours.baseline, self.eager_peak, exact)

    def calibrate(self, program) -> bool:
        """Take ``program``, the captured step unoptimized (an `OptimizedModule`
        in PyTorch's order), as a second sample of this model's float32 rounding
        beside eager's (Note [two samples of float32's rounding]): its float32
        error against eager's float64 step, per tensor, widens `slack` as
        eager's own does. Only where plans are checked in float64 (`exact`), and
        only once ``program`` passes that half: an error that is not rounding
        must not become an allowance. Returns whether it was taken; a program
        that cannot widen or fails in float64 is not (the model's checks keep
        eager's sample alone)."""
        self._program_error = {}
        if not self.exact:
            return False
        w = self._wide_step()
        try:
            wide = widen(program, w.model)
        except (TypeError, ValueError):
            return False
        if not self._check_wide(wide, w).allclose:
            return False
        ours = self._run(program, self.model, self.inputs, self.restore)
        try:
            self._program_error = _largest_differences(self.model, w.ref, ours.result, w.out)
        finally:
            self.restore()
        return True

    def _check_wide(self, wide, w: _WideStep) -> Comparison:
        """``wide`` (a runner widened onto ``w.model``) against eager's float64
        step (Note [checked in float64]); the wide copy put back afterwards."""
        got = self._run(wide, w.model, w.inputs, w.start.restore)
        try:
            return compare_models(w.ref, w.model, w.out, got.result, rtol=EXACT_RTOL,
                                  atol=0.0, rel_atol=0.0, slack=self.exact_slack())
        finally:
            w.start.restore()


def _largest_differences(a_model: nn.Module, b_model: nn.Module, a_out, b_out) -> dict[str, float]:
    """Per output, gradient and buffer (`_pairs`' names): the largest absolute
    difference between two steps, where both have it with the same shape."""
    ra, _ = flatten(a_out)
    rb, _ = flatten(b_out)
    out = {}
    for name, a, b in _pairs(a_model, b_model, ra, rb):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
                and a.shape == b.shape and a.numel():
            out[name] = (a.detach().double() - b.detach().double()).abs().max().item()
    return out


def _unoptimized(runner):
    """The unoptimized program of the step ``runner`` (an `OptimizedModule`)
    runs a plan of, on the same model, in PyTorch's order."""
    from .program import program_of       # program builds on runtime, as verify's callers do
    return program_of(runner.model, runner.captured).module()


def check_step(model: nn.Module, inputs: tuple, loss_fn, mode: str,
               make_runner: Callable[[nn.Module], Callable], *, seed: int = 0,
               rtol=RTOL, atol=ATOL, rel_atol: float = REL_ATOL) -> StepCheck:
    """One plan against eager (see ``Reference``): eager runs on a deep copy,
    ``make_runner(model)`` on ``model``, both from the same state and RNG seed;
    ``model`` is put back as it was afterwards."""
    return Reference(model, inputs, loss_fn, mode, seed).check(
        make_runner(model), rtol=rtol, atol=atol, rel_atol=rel_atol)
