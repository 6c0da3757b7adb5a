"""peers: magis_nb side by side with what a PyTorch user would pick instead.

Strategies (magis_nb/bench/peers_strategies.py): eager PyTorch;
torch.utils.checkpoint (non-reentrant) around each block; torch.compile
(inductor) with activation_memory_budget 1.0, 0.5, 0.2, 0.0; Rockmate from
PyPI (if it imports); magis_nb.optimize, a spread of its Pareto front, run as
generated (magis) and compiled by inductor (magis+inductor), planned for this
CPU (no swaps: every peak is process memory). magis-gpu plans for a GPU (with
swaps) and measures them on the CPU standing in for it: their peak is device
memory with the swapped bytes in host buffers apart (host MiB), so they are
shown in their own rows, labelled, and left out of the comparison and plots. Each
strategy runs in its own fresh process with 2 threads and is measured the same
way (magis_nb/bench/peers_harness.py): peak by torch.profiler memory events,
median time of --reps steps after 2 warm-ups, loss and gradients allclose to
eager (rtol 1e-4, atol 1e-5). Compile / solve time is reported apart.
"""
from __future__ import annotations

import json
import os

from .common import fixed_threads, parser, run_child, send_result, table, write_json
from .peers_harness import Reference, Result, add_ratios, dominated, measure, pareto

MODELS = ("unet", "gpt", "vit", "bert")
PEERS = ("eager", "checkpoint", "compile", "rockmate", "magis", "magis+inductor", "magis-gpu")
OURS = ("magis", "magis+inductor")  # their points together are magis_nb's front
STAND_IN = ("magis-gpu",)           # device memory on a stand-in: not compared


def _fmt(v, nd=3):
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def worker(a) -> int:
    """One strategy (one setting key) on one model, in this process; its rows to the parent."""
    from .. import zoo
    from .peers_strategies import strategies

    fixed_threads(2)
    case = zoo.build(a.one[0], a.size)
    ref = Reference.of(case)
    runs = dict(strategies(a.magis_time, a.magis_points, a.backend)[a.one[1]])
    results = measure(case, a.one[1], runs[a.one[2]], a.reps, ref)
    send_result([r.row() for r in results])
    return 0


def run_one(model: str, strat: str, key: str, a) -> list[Result]:
    """Run one strategy setting in a fresh process; a crash or timeout is a row too."""
    r = run_child("peers", ["--one", model, strat, key, "--size", a.size, "--reps", str(a.reps),
                            "--magis-time", str(a.magis_time), "--magis-points", str(a.magis_points),
                            "--backend", a.backend], a.timeout)
    if r.ok:
        return [Result(**row) for row in r.value]
    return [Result(model, strat, f"budget={key}" if strat == "compile" else "",
                   error=f"{r.error} ({r.seconds:.0f} s)")]


def check(results: list[Result], tol: float) -> dict:
    """Acceptance numbers per model: does magis_nb's measured front (the points of
    every strategy in OURS) dominate every peer point (peak and time/eager, each within ``tol``), and its lowest peak ratio
    within 10% time overhead. Time is the ratio to eager timed in the same process,
    so that load on the machine while one strategy ran does not decide."""
    out = {}
    for m in sorted({r.model for r in results}):
        rows = [r for r in results if r.model == m and r.peak and r.time_ratio]
        front = pareto([(r.peak, r.time_ratio) for r in rows if r.strategy in OURS])
        peers = [r for r in rows if r.strategy not in OURS + STAND_IN]
        beaten = [r for r in peers if dominated((r.peak, r.time_ratio), front, tol)]
        ok10 = [r.peak_ratio for r in rows if r.strategy in OURS and r.time_ratio is not None
                and r.peak_ratio is not None and r.time_ratio <= 1.10]
        out[m] = {"dominates": len(beaten) == len(peers) and bool(front),
                  "peer_points": len(peers), "dominated_points": len(beaten),
                  "not_dominated": [f"{r.strategy} {r.setting}".strip() for r in peers if r not in beaten],
                  "best_peak_ratio_within_10pct": min(ok10) if ok10 else None}
    return out


def main(argv) -> int:
    p = parser("peers", __doc__)
    p.add_argument("--plot", metavar="DIR", help="write one <model>.png Pareto plot per model")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--strategies", default=",".join(PEERS))
    p.add_argument("--size", default="bench", help="zoo config (default: bench)")
    p.add_argument("--reps", type=int, default=7, help="timed steps per point (median)")
    p.add_argument("--magis-time", type=float, default=60.0, help="search seconds of magis_nb")
    p.add_argument("--magis-points", type=int, default=6, help="Pareto plans to measure")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per strategy process")
    p.add_argument("--tol", type=float, default=0.02, help="noise allowed in the dominance check")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already in --json and run only what is missing")
    p.add_argument("--no-run", action="store_true",
                   help="run nothing: table, acceptance, plots (and --markdown) from --json")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument("--one", nargs=3, metavar=("MODEL", "STRATEGY", "KEY"), help=argparse_hidden())
    a = p.parse_args(argv)
    if a.one:
        return worker(a)
    from .peers_strategies import strategies

    runs = strategies(a.magis_time, a.magis_points, a.backend)
    results: list[Result] = []
    if (a.resume or a.no_run) and a.json and os.path.exists(a.json):
        with open(a.json) as f:
            results = [Result(**r) for r in json.load(f)]
    done = {(r.model, r.strategy, r.setting.removeprefix("budget=") if r.strategy == "compile" else "")
            for r in results}
    cols = [("model", "model"), ("strategy", "strategy"), ("setting", "setting"),
            ("peak_MiB", "peak MiB"), ("peak_ratio", "peak/eager"), ("time_s", "time s"),
            ("time_ratio", "time/eager"), ("time_q", "q1-q3"), ("allclose", "allclose"),
            ("max_err", "max err"), ("prep_s", "prep s"), ("first_step_s", "1st step s"), ("note", "note"),
            ("error", "error")]
    models = a.models.split(",")
    for model in models:
        for strat in a.strategies.split(","):
            for key, _ in runs[strat]:
                if (model, strat, key) in done or a.no_run:
                    continue
                rs = run_one(model, strat, key, a)
                results.extend(rs)
                add_ratios(results)
                print(table([_show(r) for r in rs], cols), flush=True)
                write_json(a.json, [r.row() for r in results])  # partial results survive
    add_ratios(results)
    print()
    print(table([_show(r) for r in results], cols))
    results.sort(key=lambda r: (models.index(r.model) if r.model in models else 99,
                                PEERS.index(r.strategy) if r.strategy in PEERS else 99))
    acc = check(results, a.tol)
    for m, v in acc.items():
        print(f"{m}: magis front dominates {v['dominated_points']}/{v['peer_points']} peer points"
              f"{'' if not v['not_dominated'] else ' (not: ' + ', '.join(v['not_dominated']) + ')'}; "
              f"lowest peak/eager within 10% time: {v['best_peak_ratio_within_10pct']}")
    if a.markdown:
        print(markdown(results))
    if not a.no_run:
        write_json(a.json, [r.row() for r in results])
    if a.plot:
        from .peers_plot import plot_model

        for m in sorted({r.model for r in results}):
            print("wrote", plot_model(results, m, os.path.join(a.plot, f"{m}.png")))
    bad = [r for r in results if r.allclose is False]
    return 1 if bad else 0


def markdown(results: list[Result]) -> str:
    head = ("| model | strategy | setting | peak MiB (process; magis-gpu: device stand-in) | peak / eager | time / eager (q1-q3) | step s | "
            "allclose (max abs err) | solve / compile s | tracker MiB | host MiB | applied / note |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.model} | {r.strategy} | {r.setting} | did not run: {r.error} "
                         "| | | | | | | | |")
            continue
        prep = {"magis": r.prep_s, "magis-gpu": r.prep_s, "compile": round(r.first_step_s, 1),
                "magis+inductor": f"{r.prep_s} + {r.first_step_s:.1f}"}.get(r.strategy, "")
        host = r.extra.get("host_bytes")
        bufs = "; BatchNorm stats differ" if r.buffers_close is False else ""
        note = r.note
        if "saved_bytes" in r.extra:
            note = f"saved for backward {r.extra['saved_bytes'] / 2**20:.1f} MiB" + (f"; {note}" if note else "")
        lines.append(
            f"| {r.model} | {r.strategy} | {r.setting} | {r.peak / 2**20:.1f} | {_fmt(r.peak_ratio)} | "
            f"{_fmt(r.time_ratio)}{_spread(r)} | {_fmt(r.time)} | {r.allclose} ({r.max_err:.1e}){bufs} | {prep} | "
            f"{'' if r.tracker_peak is None else f'{r.tracker_peak / 2**20:.1f}'} | "
            f"{'' if host is None else f'{host / 2**20:.1f}'} | {note} |")
    return "\n".join(lines)


def _spread(r: Result) -> str:
    return f" ({r.time_ratio_q[0]:.2f}-{r.time_ratio_q[1]:.2f})" if r.time_ratio_q else ""


def _show(r: Result) -> dict:
    d = r.row()
    d["time_q"] = _spread(r).strip(" ()")
    d["peak_MiB"] = _fmt(r.peak / 2**20, 1) if r.peak else ""
    if r.peak and r.strategy in STAND_IN:
        d["peak_MiB"] += " (device)"
    d["time_s"] = _fmt(r.time, 3)
    d["first_step_s"] = _fmt(r.first_step_s, 1)
    d["max_err"] = "" if r.max_err is None else f"{r.max_err:.1e}"
    d["error"] = (r.error or "")[:90]
    return d


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS
