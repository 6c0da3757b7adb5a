"""What `optimize` returns: plans on the (peak, latency) plane and the chosen one.

A `Plan` is one searched program: its simulated device peak and step latency and
what was applied to get there. `OptimizeResult` holds the unoptimized plan, the
Pareto front of everything the search saw, and the plan chosen for the budget;
`select` re-picks from the front for another budget without searching again
(the notebook's slider), `fit_measured` re-picks for a latency budget on
measured time, `module` builds the runnable `OptimizedModule` for the
chosen plan and `timeline` gives the per-category memory curve for plots.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from ..timing import PairTiming
from .report import peak_ratios, result_html, summary_table


@dataclass(frozen=True)
class Region:
    """One enabled fission region."""
    dim: str            # the D component's name, e.g. "x0[0]" (tensor x0, dim 0)
    n: int              # parts
    ops: int            # ops in the region
    first: str          # name of the region's first op (where it starts in the model)
    packed: bool = False  # its dropout masks packed 8 to a byte (Note [packed masks])
    recomputed: int = 0   # forward ops each part recomputes (Note [recomputed in parts])
    # forward ops run whole before part 0 (Note [recomputed whole before the parts])
    prologue: int = 0

    @property
    def label(self) -> str:
        return f"{self.dim}/{self.n}" + (" packed" if self.packed else "") \
            + (f" recomputing {self.recomputed}" if self.recomputed else "") \
            + (f" (+{self.prologue} whole)" if self.prologue else "")


@dataclass
class Plan:
    peak: int                       # simulated device peak, bytes
    latency: float                  # simulated step latency, seconds
    fission: list[Region] = field(default_factory=list)
    remat: list[str] = field(default_factory=list)   # ops recomputed for later users
    swaps: list[str] = field(default_factory=list)   # tensors stored to host and loaded back
    state: Any = None               # the search state (graph + order), internal
    algebra: list[str] = field(default_factory=list)  # "merge a+b+c", "sink d" (TASO subset)

    @property
    def applied(self) -> str:
        """One line: what this plan does to the program."""
        parts = []
        if self.fission:
            parts.append("fission " + ", ".join(r.label for r in self.fission))
        if self.remat:
            parts.append(f"remat {len(self.remat)}")
        if self.swaps:
            parts.append(f"swap {len(self.swaps)}")
        if self.algebra:
            parts.append(f"algebra {len(self.algebra)}")
        return "; ".join(parts) or "re-order only"

    def __repr__(self) -> str:
        return (f"Plan(peak={self.peak / 2**20:.2f} MiB, latency={self.latency * 1e3:.3f} ms, "
                f"{self.applied})")


@dataclass(frozen=True)
class MeasuredMemory:
    """One step of the chosen plan, measured when the safety net ran it, next to
    eager PyTorch's step (the CPU storage tracker: tensors the step allocates
    beyond the weights and inputs; Note [which memory] in `search.report`)."""
    eager_peak: int          # eager PyTorch's step
    peak: int                # the plan's step: the device's tensors (a stand-in on the CPU)
    host_bytes: int          # the plan module's host buffers for swapped tensors

    @property
    def process_peak(self) -> int:
        """What the process holds at the plan's peak, host buffers included."""
        return self.peak + self.host_bytes


@dataclass
class Timeline:
    """Simulated memory at every step of a plan's order, for plots."""
    by_category: dict[str, list[int]]   # device bytes per step, per category
    host: list[int]                     # bytes parked in host memory (swaps) per step
    peak: int
    peak_step: int
    regions: list[tuple[int, int, str]]  # fission regions: (first step, last step, label)

    @property
    def steps(self) -> int:
        return len(self.host)

    @property
    def total(self) -> list[int]:
        cats = list(self.by_category.values())
        return [sum(c[i] for c in cats) for i in range(self.steps)]


@dataclass
class Progress:
    """Passed to the progress callback while the search runs (and once at the end)."""
    elapsed: float          # seconds since the search started
    time_budget: float      # seconds allowed
    states: int             # states explored (scheduled and simulated)
    best_peak: int          # the best plan so far (under the budget's ordering)
    best_latency: float
    before_peak: int        # what memory ratios are of: eager's measured step (else the captured program)
    before_latency: float
    done: bool = False


ProgressFn = Callable[[Progress], Any]


@dataclass
class OptimizeResult:
    mode: str                       # "train" | "infer"
    budget_kind: str | None         # "mem" | "lat" | None (no budget: lowest peak within 10% latency)
    budget: float | None            # absolute: bytes for "mem", seconds for "lat"
    budget_ratio: float | None      # the same budget as a ratio: of `reference_peak`
                                    # for "mem", of the unoptimized latency for "lat"
    before: Plan                    # the program as captured, in PyTorch's order
    plan: Plan                      # the chosen plan
    pareto: list[Plan]              # non-dominated plans seen, by increasing peak
    met: bool                       # the chosen plan meets the budget (in simulation)
    message: str                    # one line for the user, says when the budget was missed
    profile: str                    # cost model used for latency
    seconds: float                  # optimize() in all: capture, analysis, search
    states: int                     # states explored
    interrupted: bool = False       # stopped by KeyboardInterrupt: best so far returned
    builder: Any = None             # the search's program: builds modules, timelines, plans
    _modules: dict = field(default_factory=dict)
    # seconds spent in each phase: "capture" (export and IR), "analysis" (D-Graph,
    # F-Tree, the unoptimized plan's costs), "search" (time_budget bounds this one)
    timings: dict = field(default_factory=dict)
    # children the search did not build: predicted to end past time_budget (a
    # longer search may find more; Note [a state's cost before it is built])
    too_big: int = 0
    # the safety net: plans that failed their check against eager (`search.safety`)
    failed: list = field(default_factory=list)
    verified: bool = False          # the chosen plan passed its check against eager
    # fit_measured: every (plan, measured time ratio) it tried, in order
    fits: list = field(default_factory=list)
    # fit_measured: plans it built between two adjacent plans of the front (same
    # region, the n's in between), by increasing n
    refined: list = field(default_factory=list)
    device: str = "cpu"             # where the inputs live: "cpu" | "cuda" | "meta"
    swap: bool = False              # plans could swap (Note [which memory] in `search.report`)
    # eager PyTorch's step as the user runs it (their own checkpointing included),
    # measured by the safety net; None where it did not run (Note [the budget's
    # baseline] in search/optimize.py)
    eager_peak: int | None = None
    # plans that passed the check but measured above `eager_peak`: (plan, measured
    # peak), taken off the front (Note [the budget's baseline])
    over_eager: list = field(default_factory=list)
    # times plans' steps against eager's where the step runs here (`search.walltime`;
    # None: it cannot, Note [measured at the front door] in `search.measured_choice`)
    timer: Any = None
    # training without loss_fn: where in the model's output the loss is
    # (``out[1]`` of a ``(logits, loss)``), None where the model returns it
    loss_at: str | None = None
    # id(plan) -> its `PairTiming` against eager's step, for every plan timed
    times: dict = field(default_factory=dict)
    # the plans `times` holds, kept alive so that no other plan takes one's id
    _timed: list = field(default_factory=list, repr=False)

    # -- picking another plan -------------------------------------------------------
    def select(self, mem_budget: float | int | None = None,
               lat_budget: float | None = None) -> Plan:
        """Choose from the recorded Pareto front for another budget (no new search).

        ``mem_budget``: ratio of the unoptimized peak (<= 16) or bytes; picks the
        fastest plan under it, or the lowest-peak plan when none fits.
        ``lat_budget``: ratio of the unoptimized latency; picks the lowest-peak plan
        within it, or the fastest plan when none fits. Updates ``plan``, ``met``,
        ``message``, ``budget*`` and returns the plan. Where the result can time
        plans (``timer``), the choice is then made on measured time as `optimize`
        makes it: a latency budget becomes a ratio of eager's measured step
        (Note [measured at the front door] in `search.measured_choice`).
        """
        return self.builder.select(self, mem_budget, lat_budget)

    def time_plan(self, plan: Plan) -> PairTiming | None:
        """``plan``'s step timed against eager's (`search.walltime`), once per
        plan; None when this result cannot time plans here (``timer`` None)."""
        if self.timer is None:
            return None
        if id(plan) not in self.times:
            try:
                self.times[id(plan)] = self.timer(self.module_for(plan))
                self._timed.append(plan)
            finally:
                # the process holds what it held before (host buffers included):
                # `module_for` builds it again when asked
                self.drop_module(plan)
        return self.times[id(plan)]

    @property
    def measured_time(self) -> PairTiming | None:
        """The chosen plan's step timed against eager's, or None (not timed)."""
        return self.times.get(id(self.plan))

    @property
    def time_ratio(self) -> float | None:
        """The chosen plan's measured step over eager's (median of the pairs)."""
        t = self.measured_time
        return t.ratio if t is not None else None

    def fit_measured(self, measure: Callable[[nn.Module], float] | None, lat_budget: float,
                     tries: int = 6, deadline: float | None = None) -> Plan:
        """Choose the lowest-peak plan whose *measured* time ratio is within
        ``lat_budget`` (no new search).

        ``select(lat_budget=...)`` bounds the simulated latency, the sum of the
        plan's ops timed alone; a run adds what the simulator does not see (the
        generated program's own overhead against eager PyTorch, copies competing
        with compute for memory bandwidth). ``measure(module)`` runs a plan's
        module and returns its time ratio against the reference the budget is on
        (eager PyTorch, for the bench). Along the front (peak up, latency down)
        the measured ratio falls as the simulated one does, so: measure the plan
        ``select`` picks; if it is over, measure the fastest plan; if that fits,
        bisect between the two on the front, at most ``tries`` measurements in
        all. When that ends between two splits of one region with n's in between
        that the front does not hold, those plans are built (``refined``) and
        the bisection goes on among them. ``met`` says whether a measured plan
        fits; when none does, the one that measured fastest is chosen. Every
        measurement is kept in ``fits`` as (plan, measured ratio).
        ``measure=None``: the result's own timer (`time_plan`; each plan's
        `PairTiming` kept in ``times``), a plan fitting when its
        `PairTiming.median_bound` is within the budget. ``deadline`` (a
        `time.perf_counter` value): no plan is timed after it but the first.
        """
        if lat_budget <= 0:
            raise ValueError(f"lat_budget must be positive, got {lat_budget!r}")
        if measure is None and self.timer is None:
            raise ValueError("fit_measured needs a measure(module) callback: this result "
                             "cannot time plans here (planned for another device, on the "
                             "meta device, or with verify=False)")
        base = self.before.latency
        front = sorted(self.pareto, key=lambda p: (p.peak, p.latency))
        within = [i for i, p in enumerate(front) if p.latency <= lat_budget * base]
        self.fits, self.refined = [], []
        ratios: dict[int, float] = {}

        def more() -> bool:
            return len(self.fits) < tries and (
                deadline is None or not self.fits or time.perf_counter() < deadline)

        def measured_plan(p: Plan) -> float:
            if id(p) not in ratios and not self.builder.admissible(self, p):
                ratios[id(p)] = float("inf")    # failed its check, or above eager's peak
            if id(p) not in ratios:
                if measure is None:
                    # the bound, not the median: a plan whose median lands just
                    # under the budget measures over it on fresh pairs half the time
                    ratios[id(p)] = self.time_plan(p).median_bound
                else:
                    ratios[id(p)] = float(measure(self.module_for(p)))
                    # drop it (and its host buffers) before the next plan runs: modules
                    # piling up change the process's memory, and later timings with it
                    self.drop_module(p)
                self.fits.append((p, ratios[id(p)]))
            return ratios[id(p)]

        def bisect(plans: list[Plan], good: int, bad: int) -> tuple[int, int]:
            """Indices into ``plans`` of one that fits and one measured over the
            budget (-1 or len(plans): known from elsewhere), narrowed to neighbours."""
            while abs(bad - good) > 1 and more():
                mid = (good + bad) // 2
                if measured_plan(plans[mid]) <= lat_budget:
                    good = mid
                else:
                    bad = mid
            return good, bad

        # over: a plan known to measure over the budget; ok: one known to fit
        over, ok = -1, None
        for i in ([within[0]] if within else []) + [len(front) - 1]:
            if self.fits and not more():
                break
            if measured_plan(front[i]) <= lat_budget:
                ok = i
                break
            over = i
        if ok is not None:
            ok, over = bisect(front, ok, over)
            plan = front[ok]
            if over >= 0 and ok - over == 1 and more():
                # largest n that fits among the splits in between (measured time
                # rises with n): -1 stands for front[ok], len for front[over]
                self.refined = self.builder.between(front[ok], front[over])
                good, _ = bisect(self.refined, -1, len(self.refined))
                if good >= 0:
                    plan = self.refined[good]
            ratio = ratios[id(plan)]
        elif not self.fits:                 # every plan tried failed its check
            return self.builder.select(self, lat_budget=lat_budget, measured=False)
        else:
            plan, ratio = min(self.fits, key=lambda t: t[1])
        self.plan, self.met = plan, ok is not None
        self.budget_kind, self.budget_ratio, self.budget = "lat", lat_budget, lat_budget * base
        what = f"measured latency budget x{lat_budget:.2f}"
        timed = (f"measured x{ratio:.3f} (simulated x{plan.latency / base:.3f}), "
                 if measure is not None else "")     # else the timer's words follow
        detail = (f"peak {plan.peak / 2**20:.2f} MiB ({peak_ratios(self, plan.peak)}), "
                  f"{timed}{len(self.fits)} plan(s) measured")
        self.message = (f"{what} met: {detail}" if self.met
                        else f"{what} NOT met: the fastest measured has {detail}")
        return plan

    @property
    def module(self) -> nn.Module:
        """The runnable `OptimizedModule` of the chosen plan (built once per plan)."""
        return self.module_for(self.plan)

    def module_for(self, plan: Plan) -> nn.Module:
        key = id(plan)
        if key not in self._modules:
            self._modules[key] = self.builder.module(plan)
        return self._modules[key]

    def drop_module(self, plan: Plan) -> None:
        """Forget ``plan``'s built module (and its host buffers); `module_for`
        builds it again when asked."""
        if self._modules.pop(id(plan), None) is not None:
            gc.collect()

    @property
    def built(self) -> int:
        """How many plans' modules are held (built by `module_for`, not dropped):
        each holds its host buffers, so a caller timing many plans can check
        that they do not pile up."""
        return len(self._modules)

    def plan_for_module(self, module: nn.Module) -> Plan | None:
        """The plan of the pareto front or of ``refined`` whose module
        `module_for` built as ``module`` (None: not one of them): what a
        ``measure(module)`` callback of `fit_measured` is timing."""
        return next((p for p in self.pareto + self.refined
                     if self._modules.get(id(p)) is module), None)

    def forget_modules(self) -> None:
        """Start with no built modules, without touching those already handed
        out: a `copy.copy` of a result shares its modules with the original
        until this gives it its own (empty) set."""
        self._modules = {}

    @property
    def code(self) -> str:
        """Generated PyTorch source of the chosen plan."""
        return self.module.code

    def timeline(self, plan: Plan | None = None) -> Timeline:
        return self.builder.timeline(plan or self.plan)

    @property
    def reference_peak(self) -> int:
        """What memory budgets and ratios are of: eager's measured step where it
        ran, else the captured program's simulated peak (Note [the budget's
        baseline] in search/optimize.py)."""
        return self.eager_peak if self.eager_peak is not None else self.before.peak

    @property
    def mem_ratio(self) -> float:
        """The chosen plan's peak over `reference_peak` (eager's measured step)."""
        return self.plan.peak / self.reference_peak

    @property
    def lat_ratio(self) -> float:
        return self.plan.latency / self.before.latency

    def summary(self) -> list[dict]:
        """Before/after rows (what the notebook's table and the README show)."""
        rows = []
        for label, p in (("before", self.before), ("after", self.plan)):
            t = self.times.get(id(p))
            rows.append({"plan": label, "peak_MiB": round(p.peak / 2**20, 2),
                         "latency_ms": round(p.latency * 1e3, 3), "applied": p.applied,
                         # wall time over eager's step, where the plan was timed
                         "measured_time_ratio": round(t.ratio, 3) if t is not None else None})
        return rows

    def __repr__(self) -> str:
        timed = (f"measured x{self.time_ratio:.3f} of eager's step, "
                 if self.time_ratio is not None else "")
        return (f"OptimizeResult({self.message}; peak {self.before.peak / 2**20:.2f} -> "
                f"{self.plan.peak / 2**20:.2f} MiB, {timed}simulated latency x{self.lat_ratio:.3f}, "
                f"{len(self.pareto)} Pareto plans, {self.states} states in {self.seconds:.1f} s)")

    @property
    def measured(self) -> MeasuredMemory | None:
        """The chosen plan's step measured next to eager's (None: not run, as with
        ``verify=False`` or on the meta device)."""
        return self.builder.measured(self.plan) if self.builder is not None else None

    def table(self) -> str:
        """Before/after as a Markdown table, with which memory its peaks are and
        the measured peaks (what the quick-start prints)."""
        return summary_table(self)

    def _repr_html_(self) -> str:
        return result_html(self)
