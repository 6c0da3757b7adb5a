"""The plan a budget gets, chosen on measured time where the step runs here.

Note [measured at the front door]
The simulated latency of a plan is a sum of its ops timed alone, and it can be
far from the plan's step: on a CPU a ViT plan split in 8 simulated x0.51 of
the captured program and measured x1.42 of eager's step, a segmentation
model's x3.09 measured x4.64 (issue 53). A user reads the ratio and trusts
it, so wherever the step runs on this machine (the safety net ran eager's
step, and op times are measured here: not for a GPU profile planned from a
CPU, not on the meta device) the choice is made on measured time, eager's
step timed beside each plan in interleaved pairs (`search.walltime`):

* a memory budget met: of the plans under it, the `MEASURED_PLANS` fastest
  by simulation that pass the check are timed, and the fastest measured is
  returned (two plans that simulate alike can measure 30% apart);
* a latency budget (given, or the default x1.10): it holds on measured time,
  a ratio of eager's step (`OptimizeResult.fit_measured`: a bisection along
  the front, `LAT_TRIES` timings at most);
* a memory budget not met: the plan chosen is timed.

The message, the table and the HTML report say which latency is measured
and which simulated; a plan measured above `SLOW` times eager's step is
named so in words. Timing runs after the search, in at most `TIME_SHARE` of
its seconds (or `MIN_TIMING_S`): 3 to 7 pairs per plan, as many plans as fit,
the chosen one always (``res.timings["timing"]``).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .result import OptimizeResult, Plan

MEASURED_PLANS = 3    # plans under a met memory budget timed to pick the fastest
LAT_TRIES = 5         # timings a latency budget's bisection may take
SLOW = 1.5            # a step measured above this many times eager's is said to be slow
TIME_SHARE = 0.5      # timing may take this share of the search's seconds ...
MIN_TIMING_S = 3.0    # ... or this many, whichever is more (the chosen plan is always timed)


def allowance(res: OptimizeResult) -> float:
    """Seconds the timing of one choice may take (Note above)."""
    return max(MIN_TIMING_S, TIME_SHARE * res.timings.get("search", 0.0))


def choose_measured(res: OptimizeResult, mem_budget, lat_budget, default_lat: float) -> Plan:
    """Re-make ``res``'s simulated choice on measured time (Note above); the plan."""
    t0 = time.perf_counter()
    b = res.builder
    seconds = allowance(res)
    plans = MEASURED_PLANS if mem_budget is not None and res.met else \
        1 if mem_budget is not None else LAT_TRIES
    res.timer.reps = res.timer.pairs_for(seconds, plans)
    deadline = t0 + seconds
    if mem_budget is not None:
        if res.met:
            under = sorted((p for p in res.pareto if p.peak <= res.budget),
                           key=lambda p: (p.latency, p.peak))
            timed = []
            for p in under:
                if len(timed) >= MEASURED_PLANS or (timed and time.perf_counter() > deadline):
                    break
                if p is res.plan or b.admissible(res, p):
                    timed.append((p, res.time_plan(p)))
            plan = min(timed, key=lambda pt: pt[1].ratio)[0]
            if plan is not res.plan:
                res.plan = plan
                res.message = b.describe(res, plan, "mem")
            if len(timed) > 1:
                res.message += f"; the fastest measured of {len(timed)} plans under the budget"
        else:
            res.time_plan(res.plan)
    else:
        res.fit_measured(None, default_lat if lat_budget is None else float(lat_budget),
                         tries=LAT_TRIES, deadline=deadline)
        if lat_budget is None:
            res.budget_kind = None
    words = time_words(res, res.plan)
    if words:
        res.message += "; " + words
    res.timings["timing"] = res.timings.get("timing", 0.0) + time.perf_counter() - t0
    return res.plan


def time_words(res: OptimizeResult, plan: Plan) -> str | None:
    """``plan``'s measured step against eager's, and its simulated latency, in
    words (None when it was not timed); a slow step said so plainly."""
    t = res.times.get(id(plan))
    if t is None:
        return None
    q1, q3 = t.quartiles
    sim = plan.latency / res.before.latency
    out = (f"step measured x{t.ratio:.2f} of eager's (quartiles {q1:.2f}-{q3:.2f}, "
           f"{len(t.ratios)} pairs; the cost model said x{sim:.2f})")
    if t.ratio > SLOW:
        out += (f"; SLOW: this plan's step takes {t.ratio:.1f} times as long as running "
                "the model eagerly")
    return out
