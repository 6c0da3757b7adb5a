"""simcheck: for every tiny zoo model in program order, the simulated peak next to
the measured one (CPU storage tracker), and the executor held against eager."""
from __future__ import annotations

import time

from .. import zoo
from ..program import trace
from ..verify import check_step
from .common import fixed_threads, parser, table, write_json


def check_model(name: str, size: str = "tiny", seed: int = 0) -> dict:
    case = zoo.build(name, size, seed=seed)
    t0 = time.perf_counter()
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    sim = prog.simulate().peak
    chk = check_step(case.model, case.inputs, case.loss_fn, "train",
                     lambda m: prog.module(), seed=seed)
    return {
        "model": name, "ops": prog.memgraph.n, "sim_peak": sim,
        "measured_peak": chk.measured_peak, "eager_peak": chk.eager_peak,
        "rel_error": abs(sim - chk.measured_peak) / chk.measured_peak,
        "allclose": chk.comparison.allclose,
        "max_abs_err": chk.comparison.max_abs_err,
        "mismatches": chk.comparison.mismatches[:5],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main(argv) -> int:
    p = parser("simcheck", __doc__)
    p.add_argument("--models", default=",".join(zoo.names("tiny")))
    a = p.parse_args(argv)
    fixed_threads()
    rows = [check_model(n) for n in a.models.split(",")]
    show = [dict(r, sim_peak=f"{r['sim_peak'] / 2**20:.2f}",
                 measured_peak=f"{r['measured_peak'] / 2**20:.2f}",
                 eager_peak=f"{r['eager_peak'] / 2**20:.2f}",
                 rel_error=f"{r['rel_error']:.4f}") for r in rows]
    print(table(show, [("model", "model"), ("ops", "ops"), ("sim_peak", "sim MiB"),
                       ("measured_peak", "measured MiB"), ("rel_error", "rel err"),
                       ("eager_peak", "eager MiB"), ("allclose", "allclose"),
                       ("seconds", "s")]))
    write_json(a.json, rows)
    bad = [r["model"] for r in rows if not r["allclose"] or r["rel_error"] > 0.03]
    if bad:
        print("FAILED:", ", ".join(bad))
    return 1 if bad else 0
