"""One ``%%magis`` result and the names it owns in the user namespace.

``NAME`` (default ``<model>_opt``) holds the runnable module of the chosen plan and
``NAME_result`` the `OptimizeResult`. Re-selecting a plan (slider, ``%magis_budget``)
builds the new module first and only then rebinds both names, so a failure never
leaves them pointing at different plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from IPython.core.error import UsageError

from ..search.result import OptimizeResult, Plan

MiB = 2**20


@dataclass
class Session:
    ns: dict
    name: str                       # the module's variable
    model_name: str
    result: OptimizeResult
    listeners: list = field(default_factory=list)   # called with the plan after a re-bind

    @property
    def result_name(self) -> str:
        return f"{self.name}_result"

    def bind(self) -> None:
        """Bind module and result for the current plan (module built first)."""
        module = self.result.module
        self.ns.update({self.name: module, self.result_name: self.result})

    def reselect(self, mem_budget=None, lat_budget=None) -> Plan:
        """Pick the recorded plan for another budget and re-bind; no new search."""
        if mem_budget is None and lat_budget is None:
            raise UsageError("give a memory budget (0.4, 1.5GB) or --lat RATIO")
        r = self.result
        saved = (r.plan, r.met, r.message, r.budget_kind, r.budget, r.budget_ratio)
        try:
            plan = r.select(mem_budget=mem_budget, lat_budget=lat_budget)
            self.bind()
        except BaseException:
            r.plan, r.met, r.message, r.budget_kind, r.budget, r.budget_ratio = saved
            raise
        for fn in list(self.listeners):
            fn(plan)
        return plan

    def lowest_peak(self) -> int:
        return min(p.peak for p in self.result.pareto) if self.result.pareto else self.result.plan.peak


def infeasible_message(r: OptimizeResult) -> str:
    """What to say of a budget the search could not meet (a UsageError with --strict)."""
    plans = list(r.pareto) + [r.plan]
    if r.budget_kind == "lat":
        fast = min(p.latency for p in plans)
        return (f"%%magis could not meet the latency budget x{r.budget_ratio:.2f} "
                f"({r.budget * 1e3:.3f} ms): the fastest step reached is {fast * 1e3:.3f} ms "
                f"(x{fast / r.before.latency:.3f}) in {r.seconds:.1f} s: NOT met. Raise --lat.")
    low = min(p.peak for p in plans)
    return (f"%%magis could not meet the memory budget {r.budget / MiB:.2f} MiB "
            f"(x{r.budget_ratio:.2f}): the lowest peak reached is {low / MiB:.2f} MiB "
            f"(x{low / r.reference_peak:.3f} of {r.reference_peak / MiB:.2f} MiB) in "
            f"{r.seconds:.1f} s: NOT met. Raise --mem, give the search more --time, or "
            "shrink the batch.")


def measured_infeasible_message(r: OptimizeResult) -> str:
    """What to say when no timed plan met the latency budget on measured time."""
    fastest = min(ratio for _, ratio in r.fits)
    return (f"%%magis could not meet the latency budget x{r.budget_ratio:.2f} "
            f"in wall time: the fastest of the {len(r.fits)} plan(s) timed ran at "
            f"x{fastest:.3f} of eager PyTorch's step: NOT met. Raise --lat, or pass "
            "--simulated to bound the simulated latency.")
