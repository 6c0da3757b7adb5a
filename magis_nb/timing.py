"""Time of training steps, measured one way for every bench and for ``%%magis --measured``.

A step and a reference step (eager PyTorch) alternate, pair by pair, so a burst
of load from elsewhere on the machine hits both sides of a pair alike. The time
ratio is the median of the per-pair ratios, and its spread (the quartiles of
those ratios) is reported next to it: on a 2-core machine one BERT plan's
median of 7 pairs moved between x1.06 and x1.20 from one run to the next, so a
single median cannot say on which side of a 10% bar a plan is.

On a GPU (``cuda=True``) each call is timed by CUDA events on the device
(`call_seconds`); `bench gpu` and the measured cost model (`simulate/measured.py`)
time that way.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

WARMUP = 2


@dataclass
class PairTiming:
    first_s: float            # the first warm-up step (the one that compiles, if any)
    step_s: float             # median seconds of the timed steps
    ref_s: float | None       # the reference's median seconds (None without one)
    ratios: list[float]       # step / reference, one per timed pair, in order

    @property
    def ratio(self) -> float | None:
        """Median of the per-pair ratios."""
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def quartiles(self) -> tuple[float, float] | None:
        """(first, third) quartile of the per-pair ratios."""
        if not self.ratios:
            return None
        if len(self.ratios) == 1:
            return self.ratios[0], self.ratios[0]
        q = statistics.quantiles(self.ratios, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def median_bound(self) -> float | None:
        """An upper bound on the median ratio, about 84% one-sided: the per-pair
        ratio at rank n/2 + sqrt(n)/2 (one binomial standard deviation above the
        median's rank). What a plan is fitted to a budget by
        (`OptimizeResult.fit_measured` in `bench optimize`): the median of the
        plan that measured just under a budget lands over it on fresh pairs
        about half the time, and the third quartile, which does not narrow with
        more pairs, held the tiny U-Net's unoptimized program (ATen's own
        kernels in eager's order) at x1.093 of eager (31 pairs, 2 cores)."""
        if not self.ratios:
            return None
        n = len(self.ratios)
        # n/2 + sqrt(n)/2 <= n for every n >= 1: the rank is always a pair's
        return sorted(self.ratios)[math.ceil(n / 2 + math.sqrt(n) / 2) - 1]


def call_seconds(fn: Callable, args: tuple = (), kwargs: dict | None = None, *, cuda: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call ``fn(*args, **kwargs)``: with ``cuda``, between two CUDA
    events recorded around it on the current stream (the device's time, waited
    for); otherwise by ``clock``."""
    kwargs = kwargs or {}
    if cuda:
        import torch

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kwargs)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = clock()
    fn(*args, **kwargs)
    return clock() - t0


def time_steps(step: Callable[[], object], reps: int, *, ref: Callable[[], object] | None = None,
               before: Callable[[], object] | None = None,
               ref_before: Callable[[], object] | None = None,
               warmup: int = WARMUP, cuda: bool = False,
               clock: Callable[[], float] = time.perf_counter) -> PairTiming:
    """Time ``step`` ``reps`` times after ``warmup`` warm-up calls; with ``ref``,
    each timed step is followed by one timed ``ref`` (itself warmed up once,
    after ``step``'s last warm-up). ``before`` / ``ref_before`` run untimed ahead
    of each call (e.g. clearing gradients). Each call is timed by `call_seconds`
    (CUDA events with ``cuda``, else ``clock``)."""
    if reps < 1:
        raise ValueError(f"time_steps: reps must be >= 1, got {reps}")
    steps: list[float] = []
    refs: list[float] = []
    first = 0.0

    def timed(fn, prep) -> float:
        if prep is not None:
            prep()
        return call_seconds(fn, cuda=cuda, clock=clock)

    for i in range(warmup + reps):
        dt = timed(step, before)
        if i == 0:
            first = dt
        if i >= warmup:
            steps.append(dt)
        if ref is not None and i >= warmup - 1:
            rt = timed(ref, ref_before)
            if i >= warmup:
                refs.append(rt)
    return PairTiming(first, statistics.median(steps), statistics.median(refs) if refs else None,
                      [s / r for s, r in zip(steps, refs)])


def clear_grads(params) -> Callable[[], None]:
    """A ``before`` that sets every parameter's ``.grad`` to None (steps accumulate otherwise)."""
    params = list(params)

    def run():
        for p in params:
            p.grad = None
    return run
