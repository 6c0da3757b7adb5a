"""latency: the simulated step latency of plans against their measured steps.

`Plan.latency` is the sum of the plan's ops as `simulate.measured.MeasuredCost`
times each one alone (through `search.space._CostTable`); this command measures
how far that is from the plan's module as it runs, over the corpus
(`bench.corpus_models`) and the tiny zoo (named ``zoo:NAME``), so that the
causes can be found.

Per model, in its own process (a crash or a hang costs that model's rows, with
a timeout): ``optimize(model, inputs, loss_fn, mem_budget=0.5, time_budget=--time,
max_states=--states, verify=False, measure_time=False)`` (a simulated choice,
the budget a ratio of the captured program's simulated peak), then, from that one
result (no second search), these plans, each once (a plan reached under two
labels is one row, its labels joined by "/"):

- ``before``: the unoptimized captured program (``res.before``, PyTorch's order);
- ``mem 0.5``: the plan chosen at mem_budget 0.5;
- ``lat 1.10``: ``res.select(lat_budget=1.10)``;
- ``lowest peak`` and ``fastest``: of ``res.pareto``.

The ratios (Note [the ratios]):

- ``sim_ratio`` = plan.latency / res.before.latency: simulated, the plan over the
  unoptimized program (1.0 on the ``before`` row);
- ``measured_ratio`` = the plan's module's measured step over the unoptimized
  program's module's (``res.module_for(res.before)``) measured step: the median of
  per-round ratios, ``q1``/``q3`` their quartiles (`timing.PairTiming`);
- ``rel_error`` = sim_ratio / measured_ratio - 1: how far the simulator's ratio
  is from the measured one (positive: the simulator prices the plan too high
  against the unoptimized program);
- ``eager_ratio`` = the plan's measured step over eager PyTorch's step as the
  user runs it (a deep copy of the model: forward, loss, ``backward``), with
  ``eager_q1``/``eager_q3``. On the ``before`` row it is the captured program's
  own overhead against eager.

On the ``before`` row ``measured_ratio`` is the unoptimized module against
itself (an A/A timing: two calls of the same module in each round), so its
distance from 1 and its quartiles are the timing's own noise on that model.

Note [the ratios]
The three steps (plan, unoptimized program, eager) alternate in rounds, as
`timing.time_steps` alternates two (each call timed by `timing.call_seconds`,
``timing.WARMUP`` warm-up rounds, gradients cleared before every call); the
order inside a round rotates from one round to the next so that no step always
runs after the same one. One round gives one ratio of each kind, so both
ratios of a row come from the same rounds. Rounds: at least --min-pairs, more
while they fit in --pair-seconds per plan, at most --max-pairs. The model's
state (parameters, gradients, buffers, the RNG) is put back after each plan.

Ops furthest off: for the rows with |rel_error| > --threshold, the model's
worst row and the ``before`` row, the plan's program runs --profile-steps steps
under `torch.profiler` (CPU); each step is one ``record_function`` range, the
ATen calls directly inside it are the program's ops (their inclusive time:
an op that calls others counts once, with its callees; magis_nb's Python
substitutes, `kernels.SUBSTITUTES`, are wrapped in a range named after their
op). Per op name (``aten::mm`` for targets ``aten.mm.*``) the measured ms a step
is set beside the priced ms (``res.builder.space.costs.of`` summed over the
plan's graph and order, ``plan.state.runs``), and ``ops_off`` lists the --top
names by |priced - measured|, with their node and call counts and
``repriced_ms``: the same nodes timed alone again in this process by a fresh
`MeasuredCost` with an empty cache (priced far from re-priced: the op-time
cache holds a timing that no longer holds, e.g. one taken on a busy CPU). ``profile``
holds ``step_ms`` (profiled, a step), ``ops_ms`` (the ops' time in it),
``unattributed_ms`` = step_ms - ops_ms (the program's own Python between ops:
argument passing, ``del``, gradients handed over; plus the profiler's own
per-event cost), ``unprofiled_gap_ms`` = the row's unprofiled median step -
ops_ms (noisy: two measurements, a few profiled steps against the median of
the timed ones), ``priced_ms``, ``unmatched_ms`` (measured ops whose name is no
target of the graph), and ``load1``/``canary_x`` while it was profiled.

The table prints one line per row; the summary counts the plan rows (not
``before``) with |rel_error| <= 0.10 and <= 0.25, and names the worst. JSON
(--json): a list of rows with keys model, family, plan, budget, applied, ops
(ops in the plan's order), sim_ratio, measured_ratio, q1, q3, rel_error,
eager_ratio, eager_q1, eager_q3, pairs, step_ms, base_ms, eager_ms, sim_ms,
sim_base_ms, ops_off and profile (profiled rows), load1 and canary_x (how
shared the CPU was while the row was timed: the 1-minute load average, and the
op-time canary matmul's time over its best, the larger of before and after),
error, stage, seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from ..simulate.measured import BUSY   # the canary over this many times its best: a busy CPU
from .common import fixed_threads, parser, run_child, send_result, table, write_json

DEFAULT_TIME, DEFAULT_STATES = 10.0, 60
FAST_TIME, FAST_STATES = 4.0, 20
FAST_MODELS = ("zoo:mlp", "zoo:gpt", "zoo:bert", "zoo:resnet")
MIN_PAIRS, MAX_PAIRS, PAIR_SECONDS = 7, 41, 6.0
THRESHOLD, TOP, PROFILE_STEPS = 0.10, 5, 3
ZOO = "zoo:"
STEP_MARK = "magis_nb.bench.latency.step"


# -- the models ------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    family: str
    model: Any
    inputs: Any
    loss_fn: Callable | None


def names() -> list[str]:
    """Every model this command knows: the corpus, then the tiny zoo as ``zoo:NAME``."""
    from .. import zoo
    from . import corpus_models

    return corpus_models.names() + [ZOO + n for n in zoo.names("tiny")]


def build(name: str) -> Case:
    if name.startswith(ZOO):
        from .. import zoo

        c = zoo.build(name[len(ZOO):], "tiny")
        return Case(name, "zoo", c.model, c.inputs, c.loss_fn)
    from . import corpus_models

    c = corpus_models.build(name)
    return Case(name, c.family, c.model, c.inputs, c.loss_fn)


def _family(name: str) -> str | None:
    if name.startswith(ZOO):
        return "zoo"
    from . import corpus_models

    return corpus_models.MODELS[name][0] if name in corpus_models.MODELS else None


# -- timing: plan, unoptimized program, eager in rounds ------------------------------------

@dataclass
class Rounds:
    plan_s: list[float]
    base_s: list[float]
    eager_s: list[float]
    first_s: float

    def _vs(self, ref_s: list[float]):
        from ..timing import PairTiming

        return PairTiming(self.first_s, statistics.median(self.plan_s), statistics.median(ref_s),
                          [a / b for a, b in zip(self.plan_s, ref_s)])

    def vs_base(self):
        return self._vs(self.base_s)

    def vs_eager(self):
        return self._vs(self.eager_s)


def time_rounds(calls: list[tuple[Callable, Callable | None]], *, min_pairs: int, max_pairs: int,
                seconds: float, warmup: int | None = None) -> tuple[list[list[float]], float]:
    """Seconds of each of ``calls`` ((fn, before) pairs), called in rounds: ``warmup``
    rounds, then between ``min_pairs`` and ``max_pairs`` timed rounds, as many as fit
    in ``seconds`` at the last warm-up round's pace. The order inside a round rotates
    by one each round. Returns (times per call, the first call's first seconds)."""
    from ..timing import WARMUP, call_seconds

    warmup = WARMUP if warmup is None else warmup
    n = len(calls)
    times: list[list[float]] = [[] for _ in calls]
    first = None
    reps = min_pairs
    i = 0
    while i < warmup + reps:
        t_round = 0.0
        for k in range(n):
            j = (k + i) % n
            fn, before = calls[j]
            if before is not None:
                before()
            dt = call_seconds(fn)
            t_round += dt
            if first is None and j == 0:
                first = dt
            if i >= warmup:
                times[j].append(dt)
        if i == warmup - 1 or (warmup == 0 and i == 0):
            reps = max(min_pairs, min(max_pairs, int(seconds / max(t_round, 1e-9))))
        i += 1
    return times, float(first or 0.0)


# -- the ops furthest off ----------------------------------------------------------------

def op_name(target: str) -> str:
    """The profiler's name of a graph target: ``aten.mm.default`` -> ``aten::mm``."""
    parts = target.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) >= 2 else target


@contextlib.contextmanager
def marked_substitutes():
    """While building a module: magis_nb's Python substitutes (`kernels.SUBSTITUTES`)
    wrapped in a profiler range named after their op, so their ATen calls count
    for the op they stand in for."""
    from torch.profiler import record_function

    from .. import kernels

    saved = dict(kernels.SUBSTITUTES)

    def wrap(label, fn):
        def run(*a, **kw):
            with record_function(label):
                return fn(*a, **kw)
        return run

    try:
        for target, (name, fn) in saved.items():
            kernels.SUBSTITUTES[target] = (name, wrap(op_name(target), fn))
        yield
    finally:
        kernels.SUBSTITUTES.clear()
        kernels.SUBSTITUTES.update(saved)


def priced_by_op(res, plan) -> tuple[dict[str, float], dict[str, int], dict[str, dict[str, float]]]:
    """Priced seconds per op name, nodes per op name, and seconds per target under each name."""
    g, order = plan.state.runs
    costs = res.builder.space.costs
    secs: dict[str, float] = defaultdict(float)
    nodes: dict[str, int] = defaultdict(int)
    targets: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for nid in order:
        t = g.nodes[nid].target
        c = float(costs.of(g, nid))
        k = op_name(t)
        secs[k] += c
        nodes[k] += 1
        targets[k][t] += c
    return dict(secs), dict(nodes), {k: dict(v) for k, v in targets.items()}


def profile_step(step: Callable, before: Callable | None, steps: int) -> dict:
    """``steps`` calls of ``step`` under the profiler, each in a range: per op name
    directly inside it, (ms a step, calls a step); and the range's ms a step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if before is not None:
        before()
    step()                                    # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            if before is not None:
                before()
            with record_function(STEP_MARK):
                step()
    evs = prof.events()
    marks = [e for e in evs if e.name == STEP_MARK]
    mark_ids = {id(e) for e in marks}
    ms: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in evs:
        p = getattr(e, "cpu_parent", None)
        if p is not None and id(p) in mark_ids:
            ms[e.name] += e.time_range.elapsed_us() / 1e3 / steps
            calls[e.name] += 1
    step_ms = sum(e.time_range.elapsed_us() for e in marks) / 1e3 / max(len(marks), 1)
    return {"ops": {k: (ms[k], calls[k] / steps) for k in ms}, "step_ms": step_ms}


def _fresh_cost(res):
    """A `MeasuredCost` like the search's with an empty cache of its own (a
    temporary directory, never saved), or None where the search's is not one."""
    import tempfile

    from ..simulate import measured

    cost = res.builder.space.costs.cost
    if not isinstance(cost, measured.MeasuredCost):
        return None
    fresh = measured.MeasuredCost(cost.device, cache_dir=tempfile.mkdtemp(prefix="magis_latency_"),
                                  reps=cost.reps)
    fresh.save = lambda: None                 # never written: these serve this row only
    return fresh


def ops_off(res, plan, step: Callable, before: Callable | None, *, steps: int, top: int,
            unprofiled_ms: float | None) -> tuple[list[dict], dict]:
    """The ``top`` op names by |priced - measured| and the profile's totals."""
    priced, nodes, targets = priced_by_op(res, plan)
    prof = profile_step(step, before, steps)
    measured = prof["ops"]
    keys = sorted(set(priced) | set(measured),
                  key=lambda k: -abs(priced.get(k, 0.0) * 1e3 - measured.get(k, (0.0, 0))[0]))
    rows = []
    for k in keys:
        if k not in priced:
            continue                          # no target of the graph: in unmatched
        m_ms, m_calls = measured.get(k, (0.0, 0))
        ts = targets[k]
        rows.append({"op": k, "target": max(ts, key=ts.get), "targets": sorted(ts),
                     "priced_ms": round(priced[k] * 1e3, 3), "measured_ms": round(m_ms, 3),
                     "diff_ms": round(priced[k] * 1e3 - m_ms, 3),
                     "nodes": nodes[k], "calls": round(m_calls, 2)})
        if len(rows) == top:
            break
    fresh = _fresh_cost(res)
    if fresh is not None:
        # the same ops timed alone again now, without the op-time cache: where
        # priced and re-priced differ, the cache holds a timing that no longer
        # holds (taken on a busy CPU, or before a change to how ops are timed)
        g, order = plan.state.runs
        names_ = {o["op"] for o in rows}
        again: dict[str, float] = defaultdict(float)
        for nid in order:
            k = op_name(g.nodes[nid].target)
            if k in names_:
                again[k] += float(fresh.op_cost(g, nid))
        for o in rows:
            o["repriced_ms"] = round(again.get(o["op"], 0.0) * 1e3, 3)
    ops_ms = sum(v[0] for v in measured.values())
    unmatched = {k: round(v[0], 3) for k, v in measured.items() if k not in priced}
    summary = {"step_ms": round(prof["step_ms"], 3), "ops_ms": round(ops_ms, 3),
               "unattributed_ms": round(prof["step_ms"] - ops_ms, 3),
               "unprofiled_gap_ms": None if unprofiled_ms is None else round(unprofiled_ms - ops_ms, 3),
               "priced_ms": round(sum(priced.values()) * 1e3, 3),
               "calls": round(sum(v[1] for v in measured.values()), 1),
               "nodes": sum(nodes.values()),
               "unmatched_ms": round(sum(unmatched.values()), 3),
               "unmatched": dict(sorted(unmatched.items(), key=lambda kv: -kv[1])[:top]),
               "steps": steps}
    return rows, summary


# -- one model ---------------------------------------------------------------------------

def plans_of(res) -> list[tuple[str, str, object]]:
    """(labels, budget, plan) for the rows, each plan once (labels joined by "/")."""
    cand = [("before", "none", res.before), ("mem 0.5", "mem:0.5", res.plan)]
    cand.append(("lat 1.10", "lat:1.1", res.select(lat_budget=1.10)))
    if res.pareto:
        cand.append(("lowest peak", "front", min(res.pareto, key=lambda p: (p.peak, p.latency))))
        cand.append(("fastest", "front", min(res.pareto, key=lambda p: (p.latency, p.peak))))
    out: list[list] = []
    for label, budget, plan in cand:
        for o in out:
            if o[2] is plan:
                o[0] += "/" + label
                break
        else:
            out.append([label, budget, plan])
    return [tuple(o) for o in out]


def _r(x, n=4):
    return None if x is None or not math.isfinite(x) else round(x, n)


def model_rows(name: str, *, time_budget: float = DEFAULT_TIME, max_states: int | None = DEFAULT_STATES,
               min_pairs: int = MIN_PAIRS, max_pairs: int = MAX_PAIRS,
               pair_seconds: float = PAIR_SECONDS, threshold: float = THRESHOLD, top: int = TOP,
               profile_steps: int = PROFILE_STEPS, profile: str = "worst",
               warmup: int | None = None, keep: list | None = None) -> list[dict]:
    """Every row of one model, in this process. ``profile``: "worst" (the rows
    over ``threshold``, the model's worst row and ``before``), "all" or "none".
    ``keep``: a list that gets (row, plan) for each row and then the result
    (for tests)."""
    from ..capture import eager_step, split_call
    from ..runtime.module import step_of
    from ..search import optimize
    from ..snapshot import ModelSnapshot
    from ..timing import clear_grads
    from .corpus import user_error

    t0 = time.perf_counter()
    base_row = {"model": name, "family": _family(name)}
    try:
        case = build(name)
    except Exception as e:  # noqa: BLE001 - a failure is a row
        return [dict(base_row, plan=None, budget=None, error=user_error(e), stage="build",
                     seconds=round(time.perf_counter() - t0, 2))]
    try:
        # the simulated choice (measure_time=False): what is measured here
        res = optimize(case.model, case.inputs, loss_fn=case.loss_fn, mem_budget=0.5,
                       time_budget=time_budget, max_states=max_states, verify=False,
                       measure_time=False)
        plans = plans_of(res)
    except Exception as e:  # noqa: BLE001
        return [dict(base_row, plan=None, budget=None, error=user_error(e), stage="optimize",
                     seconds=round(time.perf_counter() - t0, 2))]
    search_s = time.perf_counter() - t0
    args, kwargs = split_call(case.inputs)
    model = case.model
    eager = copy.deepcopy(model)
    clear_model = clear_grads(model.parameters())
    clear_eager = clear_grads(eager.parameters())
    base_mod = res.module_for(res.before)
    base_step = step_of(base_mod)

    def run_base():
        base_step(*args, **kwargs)

    def run_eager():
        eager_step(eager, case.inputs, case.loss_fn, "train")

    cost = res.builder.space.costs.cost

    def load() -> dict:
        # how shared the CPU was: the 1-minute load average and the op-time
        # canary's time over its best (`MeasuredCost.canary`; Note [timings
        # taken on a busy CPU] in simulate/measured.py)
        out = {"load1": round(os.getloadavg()[0], 2)}
        best = getattr(cost, "canary_best", None)
        if best:
            out["canary_x"] = round(cost.canary() / best, 2)
        return out

    rows = []
    timed = []                                 # (row, plan)
    for labels, budget, plan in plans:
        t1 = time.perf_counter()
        g, order = plan.state.runs
        row = dict(base_row, plan=labels, budget=budget, applied=plan.applied, ops=len(order),
                   sim_ratio=_r(plan.latency / res.before.latency), sim_ms=_r(plan.latency * 1e3, 3),
                   sim_base_ms=_r(res.before.latency * 1e3, 3),
                   sim_mem_ratio=_r(plan.peak / res.before.peak), measured_ratio=None, q1=None,
                   q3=None, rel_error=None, eager_ratio=None, eager_q1=None, eager_q3=None,
                   pairs=0, ops_off=None, profile=None, error=None, stage=None,
                   states=res.states, search_s=round(search_s, 2))
        snap = ModelSnapshot.of(model, grads=True, rng=True)
        busy = [load()]
        try:
            mod = base_mod if plan is res.before else res.module_for(plan)
            pstep = step_of(mod)

            def run_plan():
                pstep(*args, **kwargs)

            (ps, bs, es), first = time_rounds(
                [(run_plan, clear_model), (run_base, clear_model), (run_eager, clear_eager)],
                min_pairs=min_pairs, max_pairs=max_pairs, seconds=pair_seconds, warmup=warmup)
            r = Rounds(ps, bs, es, first)
            vb, ve = r.vs_base(), r.vs_eager()
            (q1, q3), (eq1, eq3) = vb.quartiles, ve.quartiles
            row.update(measured_ratio=_r(vb.ratio), q1=_r(q1), q3=_r(q3),
                       eager_ratio=_r(ve.ratio), eager_q1=_r(eq1), eager_q3=_r(eq3),
                       pairs=len(ps), step_ms=_r(vb.step_s * 1e3, 3), base_ms=_r(vb.ref_s * 1e3, 3),
                       eager_ms=_r(ve.ref_s * 1e3, 3))
            if row["sim_ratio"] is not None and vb.ratio:
                row["rel_error"] = _r(row["sim_ratio"] / vb.ratio - 1)
        except Exception as e:  # noqa: BLE001
            row.update(error=user_error(e), stage="time")
        finally:
            snap.restore()
            if plan is not res.before:
                res.drop_module(plan)
        busy.append(load())
        row.update({k: max(b.get(k, 0.0) for b in busy) for k in busy[0]})
        row["seconds"] = round(time.perf_counter() - t1, 2)
        rows.append(row)
        timed.append((row, plan))

    # the ops furthest off
    if profile != "none":
        ok = [(row, p) for row, p in timed if row["rel_error"] is not None]
        worst = max((t for t in ok if t[1] is not res.before), key=lambda t: abs(t[0]["rel_error"]),
                    default=None)
        for row, plan in timed:
            if row["error"] is not None:
                continue
            want = (profile == "all" or plan is res.before or (worst is not None and row is worst[0])
                    or (row["rel_error"] is not None and abs(row["rel_error"]) > threshold))
            if not want:
                continue
            snap = ModelSnapshot.of(model, grads=True, rng=True)
            busy = [load()]
            try:
                with marked_substitutes():
                    mod = res.builder.module(plan)   # its own module, substitutes marked
                pstep = step_of(mod)
                off, summ = ops_off(res, plan, lambda: pstep(*args, **kwargs), clear_model,
                                    steps=profile_steps, top=top, unprofiled_ms=row.get("step_ms"))
                busy.append(load())
                summ.update({k: max(b.get(k, 0.0) for b in busy) for k in busy[0]})
                row.update(ops_off=off, profile=summ)
            except Exception as e:  # noqa: BLE001
                row.update(profile={"error": user_error(e)})
            finally:
                snap.restore()
                mod = None
    res.forget_modules()
    if keep is not None:
        keep.extend(timed)
        keep.append(res)
    return rows


def run_isolated(name: str, child_args: list[str], timeout: float) -> list[dict]:
    r = run_child("latency", ["--one", name, *child_args], timeout)
    if r.ok and isinstance(r.value, list):
        return r.value
    why = r.error if r.timed_out else f"process died (exit status {r.returncode}): {r.error}"
    return [{"model": name, "family": _family(name), "plan": None, "budget": None,
             "error": why, "stage": "timeout" if r.timed_out else "process",
             "seconds": round(r.seconds, 2)}]


# -- report ------------------------------------------------------------------------------

COLS = [("model", "model"), ("plan", "plan"), ("applied", "applied"), ("ops", "ops"),
        ("sim_ratio", "sim"), ("measured_ratio", "measured"), ("iqr", "q1-q3"),
        ("rel_error", "rel err"), ("eager_ratio", "vs eager"), ("step_ms", "step ms"),
        ("pairs", "pairs"), ("load1", "load"), ("canary_x", "canary"), ("err", "error")]


def _short(s, n=60):
    s = " ".join(str(s or "").split())
    return s if len(s) <= n else s[:n - 3] + "..."


def show(rows: list[dict]) -> str:
    def fmt(r):
        return dict(r, applied=_short(r.get("applied"), 40),
                    iqr="" if r.get("q1") is None else f"{r['q1']:.3f}-{r['q3']:.3f}",
                    err=_short(r.get("error")),
                    **{k: "" if r.get(k) is None else r[k]
                       for k in ("sim_ratio", "measured_ratio", "rel_error", "eager_ratio", "step_ms")})
    return table([fmt(r) for r in rows], COLS)


def summary(rows: list[dict]) -> dict:
    plan_rows = [r for r in rows if r.get("plan") and not str(r["plan"]).startswith("before")
                 and r.get("rel_error") is not None]
    before = [r for r in rows if str(r.get("plan") or "").startswith("before")
              and r.get("eager_ratio") is not None]
    worst = sorted(plan_rows, key=lambda r: -abs(r["rel_error"]))
    return {"plan_rows": len(plan_rows),
            "within_0.10": sum(abs(r["rel_error"]) <= 0.10 for r in plan_rows),
            "within_0.25": sum(abs(r["rel_error"]) <= 0.25 for r in plan_rows),
            "worst": [(r["model"], r["plan"], r["rel_error"]) for r in worst[:5]],
            "errors": sum(r.get("error") is not None for r in rows),
            # timed while the CPU was shared (the canary over `measured.BUSY` times its best)
            "busy": sum((r.get("canary_x") or 0.0) > BUSY for r in rows),
            "models": len({r["model"] for r in rows}),
            "before_eager_median": _r(statistics.median([r["eager_ratio"] for r in before]))
            if before else None}


def show_ops(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if not r.get("ops_off"):
            continue
        p = r.get("profile") or {}
        out.append(f"{r['model']} / {r['plan']} (rel err {r.get('rel_error')}): profiled step "
                   f"{p.get('step_ms')} ms, ops {p.get('ops_ms')} ms, unattributed "
                   f"{p.get('unattributed_ms')} ms ({p.get('calls')} calls), priced "
                   f"{p.get('priced_ms')} ms, unmatched {p.get('unmatched_ms')} ms; "
                   f"load {p.get('load1')}, canary x{p.get('canary_x')}")
        out.append(table(r["ops_off"], [("op", "op"), ("nodes", "nodes"), ("calls", "calls"),
                                        ("priced_ms", "priced ms"), ("repriced_ms", "re-priced ms"),
                                        ("measured_ms", "measured ms"),
                                        ("diff_ms", "priced-measured")]))
    return "\n".join(out)


def main(argv) -> int:
    p = parser("latency", __doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None,
                   help="models (corpus names, zoo:NAME for the tiny zoo; default: all)")
    p.add_argument("--fast", action="store_true",
                   help=f"{', '.join(FAST_MODELS)} at --time {FAST_TIME:g} --states {FAST_STATES}")
    p.add_argument("--time", type=float, default=None,
                   help=f"search seconds per model (default {DEFAULT_TIME:g}; --fast {FAST_TIME:g})")
    p.add_argument("--states", type=int, default=None,
                   help=f"bound on searched states (default {DEFAULT_STATES}; --fast {FAST_STATES}; 0: none)")
    p.add_argument("--min-pairs", type=int, default=MIN_PAIRS, help="timed rounds per plan, at least")
    p.add_argument("--max-pairs", type=int, default=MAX_PAIRS, help="timed rounds per plan, at most")
    p.add_argument("--pair-seconds", type=float, default=PAIR_SECONDS,
                   help="seconds of timed rounds per plan beyond --min-pairs")
    p.add_argument("--threshold", type=float, default=THRESHOLD,
                   help="|rel_error| above which a row's ops are profiled")
    p.add_argument("--profile", choices=("worst", "all", "none"), default="worst",
                   help="which rows get ops_off (default: over --threshold, the model's worst, before)")
    p.add_argument("--top", type=int, default=TOP, help="ops listed per profiled row")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per model process")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--one", help=argparse.SUPPRESS, default=None)   # the child process
    a = p.parse_args(argv)
    time_budget = a.time if a.time is not None else (FAST_TIME if a.fast else DEFAULT_TIME)
    states = a.states if a.states is not None else (FAST_STATES if a.fast else DEFAULT_STATES)
    kw = dict(time_budget=time_budget, max_states=states or None, min_pairs=a.min_pairs,
              max_pairs=a.max_pairs, pair_seconds=a.pair_seconds, threshold=a.threshold,
              top=a.top, profile=a.profile)
    if a.one:
        fixed_threads(a.threads)
        import warnings
        warnings.filterwarnings("ignore")
        send_result(model_rows(a.one, **kw))
        return 0
    known = names()
    chosen = ([m for s in a.models for m in s.split(",") if m] if a.models
              else list(FAST_MODELS) if a.fast else known)
    unknown = [m for m in chosen if m not in known]
    if unknown:
        p.error(f"unknown models {', '.join(unknown)}; known: {', '.join(known)}")
    child = ["--time", str(time_budget), "--states", str(states), "--min-pairs", str(a.min_pairs),
             "--max-pairs", str(a.max_pairs), "--pair-seconds", str(a.pair_seconds),
             "--threshold", str(a.threshold), "--profile", a.profile, "--top", str(a.top),
             "--threads", str(a.threads)]
    rows: list[dict] = []
    for name in chosen:
        got = run_isolated(name, child, a.timeout)
        rows += got
        for r in got:
            print(f"{r['model']:18s} {str(r.get('plan')):28s} sim={r.get('sim_ratio')} "
                  f"measured={r.get('measured_ratio')} rel_err={r.get('rel_error')} "
                  f"eager={r.get('eager_ratio')} pairs={r.get('pairs')} {r.get('seconds')} s"
                  + (f"  error: {_short(r['error'], 120)}" if r.get("error") else ""), flush=True)
        if a.json:                             # partial results survive a long run
            write_json(a.json, rows, quiet=True)
    print()
    print(show(rows))
    ops = show_ops(rows)
    if ops:
        print("\nops furthest off (priced alone vs inside the program, ms a step):")
        print(ops)
    s = summary(rows)
    print(f"\n{s['plan_rows']} plan rows ({s['models']} models): |rel_error| <= 0.10: "
          f"{s['within_0.10']}, <= 0.25: {s['within_0.25']}; errors {s['errors']}; "
          f"timed on a busy CPU (canary > x{BUSY:g}): {s['busy']}; "
          f"unoptimized program vs eager (median over models) x{s['before_eager_median']}; worst: "
          + ", ".join(f"{m} {pl} {e:+.3f}" for m, pl, e in s["worst"]))
    write_json(a.json, rows)
    return 0
