"""``python -m magis_nb.bench sched [--json PATH]``: the scheduler's own benchmark.

(a) program-order peak vs DP peak (and the order-independent lower bound) on 10
seeded random irregular training graphs, their forward-only variants (Serenity's
setting), a BERT-sized chain-of-layers graph and the zoo graphs when available;
(b) random remat/swap/fission mutations: incremental (Algorithm 2) vs full
rescheduling time and peak.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from magis_nb.bench.common import write_json
from magis_nb.schedule import reschedule, schedule
from magis_nb.schedule.bounds import order_lower_bound
from magis_nb.schedule.random_graphs import random_graph, random_mutation, transformer_like

MiB = 1 << 20


def _row(name, kind, g, hint=None):
    prog = schedule(g, method="program", hint=hint)
    dp = schedule(g, hint=hint)
    return dp, {"graph": name, "kind": kind, "ops": g.n,
                "program_peak": prog.peak, "dp_peak": dp.peak,
                "lower_bound": order_lower_bound(g) if g.n <= 6000 else None,
                "seconds": round(dp.seconds, 4), "exact": dp.exact}


def _print_rows(rows):
    print(f"{'graph':<24}{'ops':>6}{'program MiB':>13}{'dp MiB':>10}{'saved':>8}"
          f"{'bound MiB':>11}{'seconds':>9}  exact")
    for r in rows:
        lb = "" if r["lower_bound"] is None else f"{r['lower_bound'] / MiB:.1f}"
        print(f"{r['graph']:<24}{r['ops']:>6}{r['program_peak'] / MiB:>13.1f}"
              f"{r['dp_peak'] / MiB:>10.1f}{1 - r['dp_peak'] / r['program_peak']:>8.1%}"
              f"{lb:>11}{r['seconds']:>9.3f}  {r['exact']}")


def _geo_saving(rows):
    return 1 - math.exp(statistics.fmean(math.log(r["dp_peak"] / r["program_peak"])
                                         for r in rows))


def order_peaks(n_graphs=10, zoo=True):
    rows, train_scheds = [], []
    for seed in range(n_graphs):
        g = random_graph(seed)
        dp, row = _row(f"random{seed}-train", "random-train", g)
        rows.append(row)
        train_scheds.append((g, dp))
    for seed in range(n_graphs):
        rows.append(_row(f"random{seed}-fwd", "random-forward",
                         random_graph(seed, train=False))[1])
    rows.append(_row("bert-like-80L", "chain", transformer_like(80))[1])
    if zoo:
        try:
            from magis_nb.bench.graphs import zoo_memgraphs
            for name, g, prog in zoo_memgraphs():
                rows.append(_row(name, "zoo", g, hint=prog)[1])
        except Exception as e:        # the zoo needs torch and the capture stage
            print(f"note: zoo graphs skipped ({type(e).__name__}: {e})")
    return rows, train_scheds


def incremental(train_scheds, n=100, seed=0):
    rng = random.Random(seed)
    cases = []
    for k in range(n):
        g, old = train_scheds[k % len(train_scheds)]
        ng, touched = random_mutation(g, rng)
        t0 = time.perf_counter()
        inc = reschedule(ng, old.names, touched)
        t_inc = time.perf_counter() - t0
        t0 = time.perf_counter()
        full = schedule(ng)
        t_full = time.perf_counter() - t0
        cases.append({"graph": k % len(train_scheds), "touched": sorted(touched),
                      "incremental_peak": inc.peak, "full_peak": full.peak,
                      "incremental_s": round(t_inc, 5), "full_s": round(t_full, 5),
                      "speedup": round(t_full / t_inc, 2)})
    same = sum(c["incremental_peak"] == c["full_peak"] for c in cases)
    not_worse = sum(c["incremental_peak"] <= c["full_peak"] for c in cases)
    sp = [c["speedup"] for c in cases]
    return {"median_speedup": statistics.median(sp), "min_speedup": min(sp),
            "max_speedup": max(sp), "same_quality_fraction": same / n,
            "not_worse_fraction": not_worse / n, "cases": cases}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m magis_nb.bench sched")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--graphs", type=int, default=10)
    ap.add_argument("--mutations", type=int, default=100)
    ap.add_argument("--no-zoo", action="store_true")
    args = ap.parse_args(argv)

    rows, train_scheds = order_peaks(args.graphs, zoo=not args.no_zoo)
    print("(a) peak of the program order vs the DP order (bound: no order goes below)")
    _print_rows(rows)
    for kind in ("random-train", "random-forward", "zoo"):
        sel = [r for r in rows if r["kind"] == kind]
        if sel:
            worse = sum(r["dp_peak"] > r["program_peak"] for r in sel)
            print(f"  {kind}: geometric-mean saving {_geo_saving(sel):.1%}, "
                  f"DP worse than program on {worse}/{len(sel)}")
    inc = incremental(train_scheds, args.mutations)
    print(f"\n(b) {args.mutations} random mutations: incremental vs full rescheduling")
    print(f"  median speedup {inc['median_speedup']:.1f}x "
          f"(min {inc['min_speedup']:.1f}x, max {inc['max_speedup']:.1f}x); "
          f"same peak {inc['same_quality_fraction']:.0%}, "
          f"incremental not worse {inc['not_worse_fraction']:.0%}")
    write_json(args.json, {"order_peaks": rows, "incremental": inc})
    return 0


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
