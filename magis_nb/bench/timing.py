"""Wall time of training steps on the CPU, measured one way for every bench.

A step and a reference step (eager PyTorch) alternate, pair by pair, so a burst
of load from elsewhere on the machine hits both sides of a pair alike. The time
ratio is the median of the per-pair ratios, and its spread (the quartiles of
those ratios) is reported next to it: on a 2-core machine one BERT plan's
median of 7 pairs moved between x1.06 and x1.20 from one run to the next, so a
single median cannot say on which side of a 10% bar a plan is.

(`bench gpu` times with CUDA events on the device instead: `bench/gpu.py`.)
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

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


def time_steps(step: Callable[[], object], reps: int, *, ref: Callable[[], object] | None = None,
               before: Callable[[], object] | None = None,
               ref_before: Callable[[], object] | None = None,
               warmup: int = WARMUP, clock: Callable[[], float] = time.perf_counter) -> PairTiming:
    """Time ``step`` ``reps`` times after ``warmup`` warm-up calls; with ``ref``,
    each timed step is followed by one timed ``ref`` (itself warmed up once,
    after ``step``'s last warm-up). ``before`` / ``ref_before`` run untimed ahead
    of each call (e.g. clearing gradients)."""
    if reps < 1:
        raise ValueError(f"time_steps: reps must be >= 1, got {reps}")
    steps: list[float] = []
    refs: list[float] = []
    first = 0.0

    def timed(fn, prep) -> float:
        if prep is not None:
            prep()
        t0 = clock()
        fn()
        return clock() - t0

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
