"""corpus: magis_nb on real architectures (`bench.corpus_models`: Hugging Face
decoders, encoders, encoder-decoders, vision transformers and CNNs, and plain
PyTorch models), small and random, called the way users call them.

Per model, in its own process (a crash or a hang costs one row, with a
timeout): ``optimize`` at a memory budget of 0.5 of eager PyTorch's measured peak
(in bytes) and, unless --fast, at lat_budget 1.10,
then the chosen plan and up to two more of the Pareto front (the lowest peak and
the fastest) are run against eager PyTorch from the same state and seed
(`verify.Reference.check`: loss, every .grad and every buffer, rtol 1e-4 and
atol 1e-5 plus 1e-5 of each tensor's largest magnitude where `check` takes
``rel_atol``), with the measured peak (CPU storage tracker) next to the
simulated one. A failure is a row, not a crash: ``error`` holds the message the
user saw (the exception's text, prefixed by its class for magis_nb's own errors).

Row keys: model, family, budget, captured, plans_checked, allclose, sim_peak,
measured_peak and eager_peak (bytes; the chosen plan's and eager's), mem_ratio
(measured / eager measured: the process's memory, the plans made for this CPU
without swaps; with --swap, plans for a GPU: device memory with the CPU standing
in for the device and swapped bytes in host buffers not counted), memory (which
of the two), host_bytes (those buffers) and process_ratio ((measured +
host_bytes) / eager: the process's memory, which is what a CPU run saves), lat_ratio (simulated, chosen plan / unoptimized),
sim_err (|measured - simulated| / simulated), met, applied, states, checks (one
entry per plan run), error, error_type, stage (where it failed) and seconds.

The exit status is 0 even when rows fail (this is a report) unless --strict.
"""
from __future__ import annotations

import argparse
import inspect
import os
import time
import traceback

from .common import fixed_threads, parser, run_child, send_result, table, write_json

RTOL, ATOL, REL_ATOL = 1e-4, 1e-5, 1e-5
FAST_STATES, FAST_TIME = 30, 5.0


# -- one model, in its own process -------------------------------------------------------

def user_error(exc: BaseException) -> str:
    """The message the user saw: magis_nb's own errors with their class name."""
    mod = type(exc).__module__ or ""
    if mod.split(".")[0] == "magis_nb":
        return f"{type(exc).__name__}: {exc}"
    return str(exc)


def _in_capture(exc: BaseException) -> bool:
    """Did ``exc`` come out of capturing the step (``program.trace``: export and IR)?"""
    from ..capture import CaptureError

    if isinstance(exc, CaptureError):
        return True
    for fs in traceback.extract_tb(exc.__traceback__):
        f = fs.filename.replace(os.sep, "/")
        if f.endswith("magis_nb/program.py") and fs.name == "trace":
            return True
    return False


def _fail(row: dict, stage: str, exc: BaseException) -> dict:
    row.update(error=user_error(exc), error_type=type(exc).__name__, stage=stage)
    return row


def _check_kw(ref) -> dict:
    params = inspect.signature(ref.check).parameters
    kw = {"rtol": RTOL, "atol": ATOL}
    if "rel_atol" in params:
        kw["rel_atol"] = REL_ATOL
    return kw


def _plans_to_check(res) -> list[tuple[str, object]]:
    """(label, plan): the chosen plan, then the lowest-peak and the fastest plan of
    the front where they are other plans."""
    out = [("chosen", res.plan)]
    if res.pareto:
        for label, p in (("lowest peak", min(res.pareto, key=lambda p: (p.peak, p.latency))),
                         ("fastest", min(res.pareto, key=lambda p: (p.latency, p.peak)))):
            if all(p is not q for _, q in out):
                out.append((label, p))
    return out


def budget_row(case, kind: str, budget: float, *, time_budget: float, max_states, ref_box: list,
               swap: bool = False) -> dict:
    """optimize at one budget, then the plans against eager. ``ref_box`` holds the
    `Reference` (built once per model, on first need)."""
    from ..search import optimize
    from ..verify import Reference

    t0 = time.perf_counter()
    row = {"model": case.name, "family": case.family, "budget": f"{kind}:{budget:g}",
           "captured": False, "plans_checked": 0, "allclose": None, "sim_peak": None,
           "measured_peak": None, "eager_peak": None, "mem_ratio": None, "lat_ratio": None,
           "sim_err": None, "met": None, "applied": None, "states": None, "checks": [],
           "error": None, "error_type": None, "stage": None, "seconds": None}
    kw = {"lat_budget": budget}
    if kind == "mem":
        # the budget is a fraction of what eager PyTorch measures, in bytes: the
        # captured program's own peak in program order is 10-15% off eager's either
        # way on some models (autograd's order is not the graph's)
        try:
            if not ref_box:
                ref_box.append(Reference(case.model, case.inputs, case.loss_fn, "train", seed=0))
        except Exception as e:  # noqa: BLE001
            return _fail(row, "eager", e)
        kw = {"mem_budget": budget * ref_box[0].eager_peak}
    if "verify" in inspect.signature(optimize).parameters:
        kw["verify"] = False          # the bench checks the plans itself, below
    if max_states:
        kw["max_states"] = max_states
    # Note [which memory] in search.report: planned for this CPU (no swaps) a row's
    # mem_ratio is the process's; with --swap the plans are a GPU's and mem_ratio
    # is the device stand-in's (process_ratio adds the swapped bytes' host buffers)
    kw["swap"] = swap
    row["memory"] = "device (stand-in)" if swap else "process"
    try:
        try:
            res = optimize(case.model, case.inputs, loss_fn=case.loss_fn, time_budget=time_budget, **kw)
        except Exception as e:  # noqa: BLE001 - a failure is a row
            row["captured"] = not _in_capture(e)
            return _fail(row, "capture" if not row["captured"] else "optimize", e)
        row.update(captured=True, sim_peak=res.plan.peak, lat_ratio=round(res.lat_ratio, 4),
                   sim_mem_ratio=round(res.mem_ratio, 4), sim_before_peak=res.before.peak,
                   met=res.met, applied=res.plan.applied, states=res.states,
                   optimize_seconds=round(res.seconds, 2))
        try:
            if not ref_box:
                ref_box.append(Reference(case.model, case.inputs, case.loss_fn, "train", seed=0))
            ref = ref_box[0]
        except Exception as e:  # noqa: BLE001
            return _fail(row, "eager", e)
        row["eager_peak"] = ref.eager_peak
        ckw = _check_kw(ref)
        results = []
        for which, plan in _plans_to_check(res):
            entry = {"plan": which, "applied": plan.applied, "sim_peak": plan.peak,
                     "sim_lat_ratio": round(plan.latency / res.before.latency, 4)}
            try:
                mod = res.module_for(plan)
                host = mod.host_bytes
                chk = ref.check(mod, **ckw)
            except Exception as e:  # noqa: BLE001
                entry.update(error=user_error(e), error_type=type(e).__name__)
                row["checks"].append(entry)
                if row["error"] is None:
                    _fail(row, f"run {which}", e)
                results.append(None)
                continue
            finally:
                res.drop_module(plan)
            cmp = chk.comparison
            entry.update(measured_peak=chk.measured_peak, allclose=cmp.allclose,
                         max_abs_err=cmp.max_abs_err, mismatches=cmp.mismatches[:3])
            row["checks"].append(entry)
            row["plans_checked"] += 1
            results.append(cmp.allclose)
            if plan is res.plan:
                row.update(measured_peak=chk.measured_peak, host_bytes=host,
                           mem_ratio=round(chk.measured_peak / chk.eager_peak, 4),
                           process_ratio=round((chk.measured_peak + host) / chk.eager_peak, 4),
                           sim_err=round(abs(chk.measured_peak - plan.peak) / plan.peak, 4))
        checked = [r for r in results if r is not None]
        if checked:
            # a plan that raised is not allclose; none ran: unknown
            row["allclose"] = all(checked) and len(checked) == len(results)
        return row
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 2)


def model_rows(name: str, *, fast: bool, time_budget: float, max_states, swap: bool = False) -> list[dict]:
    from . import corpus_models

    t0 = time.perf_counter()
    family = corpus_models.MODELS[name][0] if name in corpus_models.MODELS else None
    budgets = [("mem", 0.5)] + ([] if fast else [("lat", 1.10)])
    try:
        case = corpus_models.build(name)
    except Exception as e:  # noqa: BLE001
        return [_fail({"model": name, "family": family, "budget": f"{k}:{b:g}", "captured": False,
                       "plans_checked": 0, "allclose": None, "seconds": round(time.perf_counter() - t0, 2)},
                      "build", e) for k, b in budgets]
    ref_box: list = []
    return [budget_row(case, k, b, time_budget=time_budget, max_states=max_states, ref_box=ref_box,
                       swap=swap)
            for k, b in budgets]


def _lost_row(name: str, budget: str, error: str, error_type: str, seconds: float) -> dict:
    from . import corpus_models

    fam = corpus_models.MODELS[name][0] if name in corpus_models.MODELS else None
    return {"model": name, "family": fam, "budget": budget, "captured": False, "plans_checked": 0,
            "allclose": None, "sim_peak": None, "measured_peak": None, "mem_ratio": None,
            "lat_ratio": None, "error": error, "error_type": error_type, "stage": "process",
            "seconds": round(seconds, 2)}


def run_isolated(name: str, *, fast: bool, time_budget: float, max_states, timeout: float,
                 threads: int, swap: bool = False) -> list[dict]:
    """``model_rows`` in a child process: a crash or a timeout is a row."""
    args = ["--one", name, "--time-budget", str(time_budget), "--threads", str(threads)]
    if fast:
        args.append("--fast")
    if swap:
        args.append("--swap")
    if max_states:
        args += ["--max-states", str(max_states)]
    budgets = ["mem:0.5"] + ([] if fast else ["lat:1.1"])
    r = run_child("corpus", args, timeout)
    if r.ok:
        return r.value
    if r.timed_out:
        return [_lost_row(name, b, r.error, "Timeout", r.seconds) for b in budgets]
    return [_lost_row(name, b, f"process died (exit status {r.returncode}): {r.error}", "Crash",
                      r.seconds) for b in budgets]


# -- report -----------------------------------------------------------------------------------

def _mib(x):
    return "" if x is None else f"{x / 2**20:.2f}"


def _short(s, n=90):
    if not s:
        return ""
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[:n - 3] + "..."


def summary(rows: list[dict]) -> dict:
    from .corpus_models import LM_FAMILIES

    n = len(rows)
    captured = sum(bool(r.get("captured")) for r in rows)
    allclose = sum(r.get("allclose") is True for r in rows)
    lm_mem = [r for r in rows if r.get("family") in LM_FAMILIES and str(r.get("budget", "")).startswith("mem")]
    lm_half = sum(r.get("mem_ratio") is not None and r["mem_ratio"] <= 0.5 for r in lm_mem)
    return {"rows": n, "models": len({r["model"] for r in rows}), "captured": captured,
            "captured_pct": round(100 * captured / n, 1) if n else 0.0,
            "allclose": allclose, "errors": sum(r.get("error") is not None for r in rows),
            "lm_rows": len(lm_mem), "lm_mem_ratio_le_0.5": lm_half}


def families(rows: list[dict]) -> list[dict]:
    """Per family: models, rows captured, rows all allclose, the worst measured mem
    ratio at mem 0.5 and the worst |measured - simulated| / simulated."""
    from .corpus_models import FAMILIES

    out = []
    for fam in FAMILIES:
        rs = [r for r in rows if r.get("family") == fam]
        if not rs:
            continue
        mem = [r["mem_ratio"] for r in rs if str(r.get("budget", "")).startswith("mem")
               and r.get("mem_ratio") is not None]
        err = [r["sim_err"] for r in rs if r.get("sim_err") is not None]
        out.append({"family": fam, "models": len({r["model"] for r in rs}),
                    "captured": f"{sum(bool(r.get('captured')) for r in rs)}/{len(rs)}",
                    "allclose": f"{sum(r.get('allclose') is True for r in rs)}/{len(rs)}",
                    "worst_mem": max(mem) if mem else None,
                    "best_mem": min(mem) if mem else None,
                    "worst_sim_err": max(err) if err else None})
    return out


def markdown(rows: list[dict]) -> str:
    """The family summary and every row, as Markdown tables (for docs/corpus.md)."""
    def tab(head, body):
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join("" if c is None else str(c) for c in r) + " |"
                            for r in body])
    fam = tab(["family", "models", "rows captured", "rows allclose", "mem ratio at mem 0.5 (best-worst)",
               "worst sim err"],
              [(f["family"], f["models"], f["captured"], f["allclose"],
                "" if f["worst_mem"] is None else f"{f['best_mem']:.3f}-{f['worst_mem']:.3f}",
                "" if f["worst_sim_err"] is None else f"{100 * f['worst_sim_err']:.2f}%")
               for f in families(rows)])
    per = tab(["model", "family", "budget", "allclose", "plans checked", "measured MiB",
               "sim MiB", "mem ratio", "memory", "process ratio", "sim lat ratio", "applied",
               "error"],
              [(r["model"], r.get("family"), r.get("budget"), r.get("allclose"),
                r.get("plans_checked"), _mib(r.get("measured_peak")), _mib(r.get("sim_peak")),
                r.get("mem_ratio"), r.get("memory", "device (stand-in)"), r.get("process_ratio"),
                r.get("lat_ratio"),
                r.get("applied") or "",
                _short(r.get("error"), 120)) for r in rows])
    return fam + "\n\n" + per + "\n"


COLS = [("model", "model"), ("family", "family"), ("budget", "budget"), ("captured", "captured"),
        ("plans_checked", "checked"), ("allclose", "allclose"), ("sim", "sim MiB"),
        ("measured", "measured MiB"), ("sim_err", "sim err"), ("mem_ratio", "mem ratio"),
        ("lat_ratio", "lat ratio"), ("seconds", "s"), ("err", "error")]


def show(rows: list[dict]) -> str:
    return table([dict(r, sim=_mib(r.get("sim_peak")), measured=_mib(r.get("measured_peak")),
                       allclose="" if r.get("allclose") is None else r["allclose"],
                       sim_err="" if r.get("sim_err") is None else r["sim_err"],
                       mem_ratio="" if r.get("mem_ratio") is None else r["mem_ratio"],
                       lat_ratio="" if r.get("lat_ratio") is None else r["lat_ratio"],
                       err=_short(r.get("error"))) for r in rows], COLS)


def main(argv) -> int:
    from . import corpus_models

    p = parser("corpus", __doc__)
    p.add_argument("--models", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--fast", action="store_true",
                   help=f"CI: mem 0.5 only, at most {FAST_STATES} states and {FAST_TIME:g} s of search")
    p.add_argument("--time-budget", type=float, default=None,
                   help=f"search seconds per optimize (default 30; --fast {FAST_TIME:g})")
    p.add_argument("--max-states", type=int, default=None,
                   help=f"bound on searched states (default none; --fast {FAST_STATES})")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per model process (default 900; --fast 300)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a row has an error or a plan is not allclose")
    p.add_argument("--markdown", metavar="PATH", help="also write the tables as Markdown")
    p.add_argument("--swap", action="store_true",
                   help="plan for a GPU (swaps allowed): mem ratio is then device memory with "
                        "the CPU standing in, not the process's")
    p.add_argument("--one", help=argparse.SUPPRESS, default=None)   # the child process
    a = p.parse_args(argv)
    time_budget = a.time_budget if a.time_budget is not None else (FAST_TIME if a.fast else 30.0)
    max_states = a.max_states if a.max_states is not None else (FAST_STATES if a.fast else None)
    if a.one:
        fixed_threads(a.threads)
        import warnings
        warnings.filterwarnings("ignore")
        rows = model_rows(a.one, fast=a.fast, time_budget=time_budget, max_states=max_states,
                          swap=a.swap)
        send_result(rows)
        return 0
    names = a.models.split(",") if a.models else corpus_models.names()
    unknown = [n for n in names if n not in corpus_models.MODELS]
    if unknown:
        p.error(f"unknown models {', '.join(unknown)}; known: {', '.join(corpus_models.MODELS)}")
    timeout = a.timeout if a.timeout is not None else (300.0 if a.fast else 900.0)
    rows = []
    for name in names:
        got = run_isolated(name, fast=a.fast, time_budget=time_budget, max_states=max_states,
                           timeout=timeout, threads=a.threads, swap=a.swap)
        rows += got
        for r in got:
            print(f"{r['model']:18s} {r.get('budget', ''):8s} captured={r.get('captured')} "
                  f"allclose={r.get('allclose')} mem_ratio={r.get('mem_ratio')} "
                  f"lat_ratio={r.get('lat_ratio')} {r.get('seconds')} s"
                  + (f"  error: {_short(r['error'], 140)}" if r.get("error") else ""), flush=True)
    print()
    print(show(rows))
    s = summary(rows)
    print(f"\n{s['rows']} rows ({s['models']} models): captured {s['captured']} ({s['captured_pct']}%), "
          f"all plans allclose {s['allclose']}, errors {s['errors']}, "
          f"LMs with measured mem_ratio <= 0.5: {s['lm_mem_ratio_le_0.5']} of {s['lm_rows']}")
    write_json(a.json, rows)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(rows))
        print(f"wrote {a.markdown}")
    if a.strict and any(r.get("error") is not None or r.get("allclose") is not True for r in rows):
        return 1
    return 0
