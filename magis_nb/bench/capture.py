"""capture: every paper-size zoo model captured on the meta device (no activation is
allocated): ops, capture seconds, simulated program-order peak and peak RSS.

Each model runs in its own process so that the reported peak RSS is its own."""
from __future__ import annotations

import resource
import time

from .. import zoo
from .common import parser, run_child, send_result, table, write_json


def capture_one(name: str, size: str = "paper") -> dict:
    from ..program import trace

    t0 = time.perf_counter()
    case = zoo.build(name, size, device="meta")
    built = time.perf_counter() - t0
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    params = sum(p.numel() for p in case.model.parameters())
    return {
        "model": name, "description": case.description, "params": params,
        "ops": prog.memgraph.n, "build_seconds": round(built, 2),
        "capture_seconds": round(prog.captured.seconds, 2),
        "sim_peak_gib": round(prog.simulate().peak / 2**30, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main(argv) -> int:
    p = parser("capture", __doc__)
    p.add_argument("--models", default=",".join(zoo.names("paper")))
    p.add_argument("--one", help="capture one model in this process; print its row as JSON "
                   "(after common.RESULT, the line run_child reads)")
    a = p.parse_args(argv)
    if a.one:
        send_result(capture_one(a.one))
        return 0
    rows = []
    for name in a.models.split(","):
        r = run_child("capture", ["--one", name])
        rows.append(r.value if r.ok else {"model": name, "error": r.error})
        print(rows[-1], flush=True)
    print(table(rows, [("model", "model"), ("params", "params"), ("ops", "ops"),
                       ("capture_seconds", "capture s"), ("sim_peak_gib", "sim peak GiB"),
                       ("peak_rss_mib", "peak RSS MiB"), ("description", "config")]))
    write_json(a.json, rows)
    return 1 if any("error" in r for r in rows) else 0
