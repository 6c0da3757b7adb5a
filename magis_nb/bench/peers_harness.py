"""The peers harness: one way to measure every strategy, one result type (CPU).

A strategy turns a zoo case into one or more `Candidate`s: a `step()` that runs
forward + backward of one training step (gradients land on `params`), the
parameters and buffers it trains, and the seconds it took to prepare (solve,
compile). `measure` runs every candidate the same way: 2 warm-up steps (the
first compiles), `reps` timed steps, each followed by a timed eager step
(`timing.time_steps`: the time ratio is the median of the pairs' ratios, its
quartiles its spread), then one step from the
initial state and seed 0 under `torch.profiler` for the peak and the loss and
gradients to hold against eager's.

Peak: see Note [profiler peak]. A `TorchDispatchMode` tracker would stop
`torch.compile` from compiling, so it is only a cross-check (`tracker_peak`) for
strategies that do not compile.
"""
from __future__ import annotations

import copy
import gc
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import nn

from ..capture import eager_step
from ..runtime.measure import measure_cpu, storage_bytes
from ..snapshot import ModelSnapshot
from ..timing import clear_grads, time_steps
from ..verify import ATOL, REL_ATOL, RTOL, normalizes_by_batch
from ..verify import Reference as StepReference


@dataclass
class Candidate:
    setting: str                      # e.g. "budget=0.5", "plan 3/7", "" for eager
    step: Callable[[], torch.Tensor]  # one training step, returns the (detached) loss
    params: list[nn.Parameter]        # where its gradients land, in the model's order
    buffers: list[torch.Tensor]       # its model's buffers (BatchNorm stats), same order
    prep_s: float = 0.0               # solve / build time before the first step
    trackable: bool = True            # a TorchDispatchMode does not change what runs
    note: str = ""
    extra: dict = field(default_factory=dict)
    forward: Callable[[], object] | None = None  # forward only (returns what backward needs)
    release: Callable[[], None] | None = None    # drops what step built, once it is measured


@dataclass
class Result:
    """One strategy at one setting on one model; the JSON row of `bench peers`."""
    model: str
    strategy: str
    setting: str
    peak: int | None = None           # bytes: live before the step + step peak
    time: float | None = None         # median seconds per step
    eager_time: float | None = None   # eager's median, timed interleaved in the same process
    peak_ratio: float | None = None   # peak / eager's peak
    time_ratio: float | None = None   # median of step / eager step, pair by pair (same process, same load)
    time_ratio_q: list[float] | None = None  # quartiles [q1, q3] of those per-pair ratios (its spread)
    allclose: bool | None = None      # loss and every gradient vs eager (rtol 1e-4, atol 1e-5)
    max_err: float | None = None      # largest absolute difference of loss / gradients
    buffers_close: bool | None = None # BatchNorm running stats vs eager (checkpoint recomputes them)
    error: str | None = None          # why it did not run
    prep_s: float | None = None       # solve / compile seconds, not in `time`
    first_step_s: float | None = None # the first call (compiles for torch.compile)
    tracker_peak: int | None = None   # cross-check: CPU storage tracker, where it can run
    note: str = ""
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        return asdict(self)


# Note [profiler peak]: torch.profiler(profile_memory=True) records one "[memory]"
# event per allocator call (+bytes) and per free (-bytes). Sorted by time, their
# running sum is the memory the step allocated on top of what was live before it;
# its maximum plus the bytes live before the step (parameters, buffers, inputs;
# gradients are None) is the step's peak. It also sees allocations that are not
# tensor storages, which the storage tracker cannot: 32 bytes on the transformers'
# eager steps (tests/test_peers.py holds the two within 1%), about 10 MiB on the
# U-Net's (its convolutions).
def profiled_peak(fn: Callable[[], object], live_before: int):
    """(peak bytes, fn's result) of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    cur = top = 0
    for e in events:
        cur += e.nbytes()
        top = max(top, cur)
    return live_before + top, out


def saved_bytes(forward: Callable[[], object]) -> int:
    """Bytes a forward leaves allocated for its backward (what
    activation_memory_budget acts on): the profiler's running sum at its end."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward()
    del out
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)


@dataclass
class Reference:
    """Eager PyTorch's step from the case's initial state with seed 0."""
    loss: torch.Tensor
    grads: list[torch.Tensor | None]
    buffers: list[torch.Tensor]
    model: nn.Module                  # the eager copy (timed next to every candidate)
    case: object = None
    # more atol per gradient and buffer, in their order: for a model normalizing
    # by its batch, the safety net's allowance (Note [phased BatchNorm's rounding])
    grad_slack: list[float] | None = None
    buffer_slack: list[float] | None = None

    def eager(self) -> tuple[Callable[[], object], list]:
        return (lambda: eager_step(self.model, self.case.inputs, self.case.loss_fn, "train"),
                list(self.model.parameters()))

    @classmethod
    def of(cls, case) -> "Reference":
        ref = copy.deepcopy(case.model)
        for p in ref.parameters():
            p.grad = None
        torch.manual_seed(0)
        loss = eager_step(ref, case.inputs, case.loss_fn, "train")
        out = cls(loss.detach().clone(), [p.grad.clone() if p.grad is not None else None
                                          for p in ref.parameters()],
                  [b.detach().clone() for b in ref.buffers()], ref, case)
        if normalizes_by_batch(case.model, "train"):
            slack = StepReference(case.model, case.inputs, case.loss_fn, "train").slack()
            out.grad_slack = [slack.get(f"grad {n}", 0.0) for n, _ in ref.named_parameters()]
            out.buffer_slack = [slack.get(f"buffer {n}", 0.0) for n, _ in ref.named_buffers()]
        return out

    def compare(self, loss, params, buffers, rtol=RTOL, atol=ATOL) -> tuple[bool, float, bool]:
        """(loss and grads allclose, max abs error, buffers allclose)."""
        ok, err = True, 0.0
        pairs = [(self.loss, loss)] + list(zip(self.grads, [p.grad for p in params], strict=True))
        extra = [0.0] + (self.grad_slack or [0.0] * len(self.grads))
        for (a, b), more in zip(pairs, extra):
            if (a is None) != (b is None):
                return False, float("inf"), False
            if a is None:
                continue
            a, b = a.detach().float(), b.detach().float()
            if a.shape != b.shape:
                return False, float("inf"), False
            err = max(err, (a - b).abs().max().item() if a.numel() else 0.0)
            ok = ok and torch.allclose(a, b, rtol=rtol, atol=atol + more + _rel(a))
        bextra = self.buffer_slack or [0.0] * len(self.buffers)
        bufs = all(torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol + more + _rel(a))
                   for a, b, more in zip(self.buffers, buffers, bextra, strict=True))
        return ok, err, bufs


def _rel(a: torch.Tensor) -> float:
    """The atol a tensor's own scale adds (verify.REL_ATOL)."""
    return REL_ATOL * a.detach().float().abs().max().item() if a.numel() else 0.0


def measure(case, strategy: str, make: Callable, reps: int = 7,
            ref: Reference | None = None) -> list[Result]:
    """Run ``make(case) -> [Candidate]`` and measure every candidate (see module doc)."""
    ref = ref or Reference.of(case)
    try:
        cands = make(case)
    except Exception as e:  # the strategy could not be built: say why, in the table
        return [Result(case.name, strategy, "", error=f"{type(e).__name__}: {e}".strip()[:500])]
    live_before = storage_bytes(list(case.inputs))
    out = []
    for c in cands:
        r = Result(case.name, strategy, c.setting, prep_s=round(c.prep_s, 2), note=c.note,
                   extra=dict(c.extra))
        try:
            # parameters and buffers as they were before any step (restored before the check)
            state = ModelSnapshot.of_tensors(list(c.params) + list(c.buffers), c.params)
            against = None if strategy == "eager" else ref.eager()
            t = time_steps(c.step, reps, before=clear_grads(c.params),
                           ref=against and against[0], ref_before=against and clear_grads(against[1]))
            r.first_step_s, r.time = t.first_s, t.step_s
            r.eager_time = t.step_s if strategy == "eager" else t.ref_s
            if t.ratios:
                r.time_ratio = round(t.ratio, 4)
                r.time_ratio_q = [round(q, 4) for q in t.quartiles]
            state.restore()
            base = live_before + storage_bytes(list(c.params) + list(c.buffers))
            torch.manual_seed(0)
            r.peak, loss = profiled_peak(c.step, base)
            r.allclose, r.max_err, r.buffers_close = ref.compare(loss, c.params, c.buffers)
            if c.forward is not None:
                state.restore()
                torch.manual_seed(0)
                r.extra["saved_bytes"] = saved_bytes(c.forward)
            if c.trackable:
                state.restore()
                torch.manual_seed(0)
                r.tracker_peak = measure_cpu(c.step, []).peak + base
            state.restore()
        except Exception as e:
            r.error = f"{type(e).__name__}: {e}".strip()[:500]
        finally:
            if c.release is not None:
                c.release()
                gc.collect()
        out.append(r)
    return out


def add_ratios(results: list[Result]) -> None:
    """peak_ratio against the eager row of the same model; time_ratio, where
    `measure` did not set it (eager's row; rows of older JSON), the ratio of the
    row's median to eager's median measured next to it."""
    eager = {r.model: r for r in results if r.strategy == "eager" and r.peak}
    for r in results:
        e = eager.get(r.model)
        if e and r.peak:
            r.peak_ratio = round(r.peak / e.peak, 4)
        if r.time_ratio is None and r.time and r.eager_time:
            r.time_ratio = round(r.time / r.eager_time, 4)


def dominated(point: tuple[float, float], front: list[tuple[float, float]], tol: float = 0.02) -> bool:
    """Is ``point`` (peak, time) matched by a front point with peak and time both
    <= its own (each within ``tol`` relative noise)?"""
    p, t = point
    return any(fp <= p * (1 + tol) and ft <= t * (1 + tol) for fp, ft in front)


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Non-dominated (peak, time) points, by increasing peak."""
    front = []
    for p, t in sorted(set(points)):
        if not front or t < front[-1][1]:
            front.append((p, t))
    return front
