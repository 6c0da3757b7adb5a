"""optimize: the whole optimizer under budgets.

(a) tiny zoo models on this CPU with measured op costs, at lat_budget 1.10 and at
mem_budget 0.4, each planned twice: as a CPU plan (no swaps: its memory is the
process's) and as a GPU stand-in (swaps allowed: the measured peak is the
stand-in device's, the swapped bytes sit in host buffers beside it, and the
process ratio counts them). Searches are bounded by states (--max-states), not
seconds, so a re-run on the same op-cost cache searches the same plans. A
latency budget is on measured time: the search bounds
simulated latency, then `OptimizeResult.fit_measured` re-picks from its front
until a plan measures within the budget (an upper bound of its median ratio,
`timing.PairTiming.median_bound`; at most 6 plans timed); the chosen
plan is then timed again. Reported: the chosen plan's measured peak (CPU
storage tracker) against eager PyTorch's; its measured wall time against
eager's (optimized and eager steps alternate, 2 warm-ups, then the median of
--reps per-pair ratios and their quartiles, same thread count:
`timing.time_steps`); its simulated peak; whether it is allclose to eager; and
its swap copies' time in the step against their price in the search
(`swap_copies`). (b) paper-size models planned for a simulated RTX 3090 at
lat_budget 1.10 and 1.05 and mem_budget 0.8 and 0.4: simulated memory ratio and
latency overhead (nothing runs: the models live on the meta device), and the
op floor: resident bytes plus the largest working set of one op, below which
no plan that keeps every op whole (no fission) can go; and, for a step with
training BatchNorm, the lat floor: below it no plan of the search's space goes
at that latency (the budget, or a memory budget's plan's latency), fission
included (`search.floor`).
"""
from __future__ import annotations

import copy
import itertools
import time

from .. import zoo
from ..capture import eager_step
from ..rules.swap import swap_ops
from ..search import optimize
from ..search.floor import barrier_floor
from ..simulate.memory import op_floor
from ..timing import clear_grads, time_steps
from ..verify import Reference
from .common import fixed_threads, parser, table, write_json

CPU_MODELS = ("unet", "unetpp", "gpt", "vit", "bert")
PAPER_MODELS = ("resnet", "bert", "vit", "unet", "unetpp", "gpt", "btlm", "unet-nobn", "unetpp-nobn",
                "unetpp-magis")
CPU_BUDGETS = (("lat", 1.10), ("mem", 0.4))
# (a)'s two plans per model and budget: the memory each one's ratio is of
MEMORY_KINDS = {"process": False, "stand-in": True}     # kind -> swap allowed
PAPER_BUDGETS = (("lat", 1.10), ("lat", 1.05), ("mem", 0.8), ("mem", 0.4))


def cpu_row(name: str, kind: str, budget: float, time_budget: float, reps: int,
            memory: str = "process", max_states: int | None = None) -> dict:
    case = zoo.build(name, "tiny")
    kw = {"mem_budget": budget} if kind == "mem" else {"lat_budget": budget}
    t0 = time.perf_counter()
    res = optimize(case.model, case.inputs, loss_fn=case.loss_fn, time_budget=time_budget,
                   max_states=max_states, swap=MEMORY_KINDS[memory], **kw)
    seconds = time.perf_counter() - t0
    ref = Reference(case.model, case.inputs, case.loss_fn, "train")
    eager_model = copy.deepcopy(case.model)

    def timed(mod):
        t = time_steps(lambda: mod.step(*case.inputs), reps, before=clear_grads(case.model.parameters()),
                       ref=lambda: eager_step(eager_model, case.inputs, case.loss_fn, "train"),
                       ref_before=clear_grads(eager_model.parameters()))
        ref.restore()  # timing trained the model: back to the state the reference holds
        return t

    sim_pick = res.plan
    # Every timing in one process state: the first run under the storage tracker
    # (ref.check) leaves split programs slower against eager for the rest of the
    # process (ViT tiny split in 8: x0.93-0.96 timed before any check, x1.08-1.16
    # after), and the chosen plan is checked before its final timing. So check
    # once before fit_measured times anything (the check of the final plan when
    # fit_measured keeps the pick).
    chk = ref.check(res.module)
    if kind == "lat":
        # The budget is on measured time: re-pick from the front until a plan
        # measures within it, then time the chosen plan again on fresh pairs (the
        # pick's own measurement is biased low: it was chosen for being low).
        # A plan fits on an upper bound of its median, not the median (why:
        # `PairTiming.median_bound`; BERT split in 6 fitted under x1.10 on its
        # median re-timed x1.102).
        res.fit_measured(lambda m: timed(m).median_bound, budget)
        if res.plan is not sim_pick:
            chk = ref.check(res.module)
    mod = res.module
    t = timed(mod)
    q1, q3 = t.quartiles
    copies = swap_copies(res, mod, lambda: mod.step(*case.inputs))
    ref.restore()
    host = mod.host_bytes
    return {"model": name, "size": "tiny", "profile": res.profile, "budget_kind": kind,
            "budget": budget, "met": res.met, "memory": memory,
            "mem_ratio": round(chk.measured_peak / chk.eager_peak, 4),
            "host_bytes": host,
            "process_ratio": round((chk.measured_peak + host) / chk.eager_peak, 4),
            "sim_mem_ratio": round(res.plan.peak / res.before.peak, 4),
            "sim_peak": res.plan.peak, "measured_peak": chk.measured_peak,
            "sim_vs_measured": round(abs(res.plan.peak - chk.measured_peak) / chk.measured_peak, 4),
            "lat_ratio": round(t.ratio, 4), "lat_ratio_q1": round(q1, 4), "lat_ratio_q3": round(q3, 4),
            "eager_s": round(t.ref_s, 4), "opt_s": round(t.step_s, 4),
            "sim_lat_ratio": round(res.lat_ratio, 4),
            "measured": True, "allclose": chk.comparison.allclose, **copies,
            "applied": res.plan.applied, "states": res.states, "seconds": round(seconds, 1),
            # lat rows: the plan select() picked on simulated latency, and each plan
            # fit_measured timed on the way (its measured ratio)
            "tried": len(res.fits), "sim_pick": sim_pick.applied,
            "sim_pick_lat_ratio": round(sim_pick.latency / res.before.latency, 4),
            "fits": [[p.applied, round(p.peak / res.before.peak, 4), round(r, 4)]
                     for p, r in res.fits]}


def swap_copies(res, mod, step, steps: int = 3) -> dict:
    """The plan's swap copies (Stores and Loads): ms a step as timed in the step
    (`TimedSyncCopies`), as the search priced them (transfers at the copy
    bandwidth), and as each copy op timed alone would price them."""
    st = res.plan.state
    g = st.graph
    stores, loads = swap_ops(g)
    ids = set(stores) | set(loads)
    if not ids:
        return {"copies_ms": 0.0, "copies_priced_ms": 0.0, "copies_alone_ms": 0.0}
    costs = res.builder.space.costs
    priced = sum(costs.of(g, v) for v in st.order if v in ids)
    alone = sum(costs.cost.op_cost(g, v) for v in st.order if v in ids)
    mod.timed_copies = True
    try:
        step()
        mod.transfer_stats()            # drop the warm-up step's
        for _ in range(steps):
            step()
        inside = mod.transfer_stats().transfer_s / steps
    finally:
        mod.timed_copies = False
    return {"copies_ms": round(inside * 1e3, 2), "copies_priced_ms": round(priced * 1e3, 2),
            "copies_alone_ms": round(alone * 1e3, 2)}


def paper_row(name: str, kind: str, budget: float, time_budget: float, profile: str) -> dict:
    case = zoo.build(name, "paper", device="meta")
    kw = {"mem_budget": budget} if kind == "mem" else {"lat_budget": budget}
    t0 = time.perf_counter()
    res = optimize(case.model, case.inputs, loss_fn=case.loss_fn, time_budget=time_budget,
                   device_profile=profile, **kw)
    mg, _, _ = res.before.state.graph.memgraph()
    # a lat row's floor is at its budget, a mem row's at its plan's latency
    g, order = res.before.state.runs
    floor = barrier_floor(g, order, res.builder.space.costs,
                          budget if kind == "lat" else res.lat_ratio)
    return {"model": name, "size": "paper", "profile": profile, "budget_kind": kind,
            "budget": budget, "met": res.met, "mem_ratio": round(res.mem_ratio, 4),
            # no plan that keeps every op whole (no fission) goes below this
            "op_floor": round(op_floor(mg) / res.before.peak, 4),
            # no plan at that latency goes below this (search/floor.py; BatchNorm steps only)
            "lat_floor": round(floor.bytes / res.before.peak, 4) if floor else None,
            "lat_ratio": round(res.lat_ratio, 4), "measured": False, "allclose": None,
            "peak_before_MiB": round(res.before.peak / 2**20), "peak_after_MiB": round(res.plan.peak / 2**20),
            "applied": res.plan.applied, "states": res.states, "too_big": res.too_big,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv) -> int:
    p = parser("optimize", __doc__)
    p.add_argument("--part", choices=("a", "b", "all"), default="all")
    p.add_argument("--time-budget", type=float, default=None,
                   help="search seconds per run (default: 60 for part b; part a is bounded "
                   "by --max-states, with 600 s as a guard)")
    p.add_argument("--max-states", type=int, default=80,
                   help="states per search in part (a) (default 80): the same plans on a re-run")
    p.add_argument("--memory", default="process,stand-in",
                   help="part (a)'s plans: process (no swaps), stand-in (swaps allowed)")
    p.add_argument("--cpu-models", default=",".join(CPU_MODELS))
    p.add_argument("--paper-models", default=",".join(PAPER_MODELS))
    p.add_argument("--profile", default="rtx3090", help="device profile for part (b)")
    p.add_argument("--reps", type=int, default=31,
                   help="timed pairs (plan, eager) per measurement: median ratio and quartiles")
    p.add_argument("--budgets", default=None,
                   help="only these budgets, e.g. 'lat:1.10,mem:0.4' (default: the issue's set per part)")
    a = p.parse_args(argv)
    only = None
    if a.budgets:
        only = [(k, float(v)) for k, v in (s.split(":") for s in a.budgets.split(","))]
    fixed_threads()
    rows = []
    cols = [("model", "model"), ("budget_kind", "kind"), ("budget", "budget"), ("met", "met"),
            ("mem_ratio", "mem ratio"), ("lat_ratio", "lat ratio")]
    if a.part in ("a", "all"):
        for name, (kind, b), memory in itertools.product(
                a.cpu_models.split(","), only or CPU_BUDGETS, a.memory.split(",")):
            r = cpu_row(name, kind, b, a.time_budget or 600.0, a.reps, memory, a.max_states)
            rows.append(r)
            print(table([r], cols + [("memory", "memory"), ("process_ratio", "process"),
                                     ("lat_ratio_q1", "q1"), ("lat_ratio_q3", "q3"),
                                     ("sim_mem_ratio", "sim mem"), ("sim_lat_ratio", "sim lat"),
                                     ("sim_vs_measured", "sim err"), ("tried", "timed"),
                                     ("copies_ms", "copies ms"), ("copies_priced_ms", "priced"),
                                     ("copies_alone_ms", "alone"),
                                     ("allclose", "allclose"),
                                     ("applied", "applied"), ("seconds", "s")]), flush=True)
    if a.part in ("b", "all"):
        for name in a.paper_models.split(","):
            for kind, b in only or PAPER_BUDGETS:
                r = paper_row(name, kind, b, a.time_budget or 60.0, a.profile)
                rows.append(r)
                print(table([r], cols + [("op_floor", "op floor"), ("lat_floor", "lat floor"),
                                         ("peak_before_MiB", "before MiB"),
                                         ("peak_after_MiB", "after MiB"), ("applied", "applied"),
                                         ("states", "states"), ("seconds", "s")]), flush=True)
    write_json(a.json, rows)
    bad = [r for r in rows if r["allclose"] is False
           or (r["measured"] and r["met"] and r["sim_vs_measured"] > 0.03)]
    print(f"{len(rows)} runs, {len(bad)} failing (not allclose, or feasible but measured >3% off)")
    return 1 if bad else 0
