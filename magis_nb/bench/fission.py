"""fission: per tiny zoo model, the D components and the F-Tree candidates per level;
every candidate split at n=2 and at its largest n, each simulated, measured (CPU
storage tracker) and held against eager PyTorch (fp32, rtol 1e-4, atol 1e-5; a
split that misses that tolerance is re-checked in float64, rtol 1e-7, to tell a
wrong program from amplified fp32 rounding: column fp64).

Image regions tiled along height and along height and width are among the
candidates: a training step's backward (Note [gradients in tiles] in
analysis/spatial.py) and, with ``--infer``, each model's inference in eval mode
instead (``mode="infer"``, the target left out; Note [tiles with halos])."""
from __future__ import annotations

import time
from collections import Counter

from .. import zoo
from ..analysis import DGraph, FTrans, apply_fission, build_ftree
from ..analysis.spatial import region_rank, spatial_candidates, tiles_name
from ..program import trace
from ..verify import Reference
from .common import fixed_threads, parser, table, write_json


def _fp64_checker(name: str, prog, seed: int):
    """The same program in float64, to tell a wrong split from fp32 rounding.

    Some tiny models amplify rounding enormously: in the tiny ResNet, scaling the
    input by (1 + 1e-7) moves gradients by 4% of their largest entry (max-pool
    argmax ties flip). A split that changes only the order of fp32 rounding then
    fails an fp32 allclose, while in float64 it agrees to ~1e-12.
    """
    case = zoo.build(name, "tiny", seed=seed)
    model = case.model.double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in case.inputs)
    p64 = trace(model, inputs, loss_fn=case.loss_fn)
    if [n.target for n in p64.graph.nodes] != [n.target for n in prog.graph.nodes]:
        return None
    dg64 = DGraph(p64.graph)
    ref64 = Reference(model, inputs, case.loss_fn, "train", seed)

    def check(f: FTrans):
        split = p64.with_graph(apply_fission(dg64, [f]))
        return ref64.check(split.module(), rtol=1e-7, atol=1e-10).comparison.allclose
    return check


def fission_rows(name: str, *, max_candidates: int | None = None, ns=("2", "max"),
                 seed: int = 0, infer: bool = False) -> tuple[dict, list[dict]]:
    case = zoo.build(name, "tiny", seed=seed)
    mode, inputs, loss_fn = "train", case.inputs, case.loss_fn
    if infer:
        case.model.eval()
        mode, loss_fn = "infer", None
        inputs = case.inputs[:-1] if case.loss_fn is not None else case.inputs
    prog = trace(case.model, inputs, loss_fn=loss_fn, mode=mode)
    dg = DGraph(prog.graph)
    hot = prog.hotspots()
    cands = build_ftree(dg, hot)
    cands += spatial_candidates(prog.graph, hot, len(cands))
    ref = Reference(case.model, inputs, loss_fn, mode, seed)
    base = ref.check(prog.module())
    info = {"model": name, "components": len(dg.components),
            "dims": [f"{c.name}:{len(c.axis_of)}" for c in dg.components[:6]],
            "candidates_per_level": dict(sorted(Counter(c.level for c in cands).items())),
            "baseline_measured_peak": base.measured_peak, "baseline_sim_peak": prog.simulate().peak}
    rows = []
    fp64 = None
    for c in cands[:max_candidates]:
        for n in sorted({2 if s == "2" else c.max_n for s in ns}):
            if c.max_n % n:
                continue
            t0 = time.perf_counter()
            p2 = prog.with_graph(apply_fission(dg, [c.ftrans(n)]))
            sim = p2.simulate().peak
            chk = ref.check(p2.module())
            exact64 = None
            if not chk.comparison.allclose and not infer:
                fp64 = fp64 or _fp64_checker(name, prog, seed)
                exact64 = fp64(c.ftrans(n)) if fp64 else None
            rows.append({
                "model": name, "candidate": c.id, "level": c.level,
                "dim": tiles_name(c.tiles, region_rank(prog.graph, c.ops)) if c.tiles
                else dg.components[c.comp].name,
                "ops": len(c.ops), "n": n, "sim_peak": sim, "measured_peak": chk.measured_peak,
                "baseline_measured_peak": base.measured_peak,
                "rel_error": abs(sim - chk.measured_peak) / chk.measured_peak,
                "allclose": chk.comparison.allclose, "max_abs_err": chk.comparison.max_abs_err,
                "allclose_fp64": exact64,
                "seconds": round(time.perf_counter() - t0, 2)})
    return info, rows


def main(argv) -> int:
    p = parser("fission", __doc__)
    p.add_argument("--models", default=",".join(zoo.names("tiny")))
    p.add_argument("--max-candidates", type=int, default=None)
    p.add_argument("--infer", action="store_true",
                   help="inference in eval mode (spatial tiles among the candidates)")
    a = p.parse_args(argv)
    fixed_threads()
    all_rows, infos = [], []
    for name in a.models.split(","):
        info, rows = fission_rows(name, max_candidates=a.max_candidates, infer=a.infer)
        infos.append(info)
        all_rows += rows
        print(f"{name}: {info['components']} D components (largest: {', '.join(info['dims'])}); "
              f"candidates per level {info['candidates_per_level']}; "
              f"unsplit peak {info['baseline_measured_peak'] / 2**20:.2f} MiB", flush=True)
        show = [dict(r, sim=f"{r['sim_peak'] / 2**20:.2f}", meas=f"{r['measured_peak'] / 2**20:.2f}",
                     ratio=f"{r['measured_peak'] / r['baseline_measured_peak']:.3f}",
                     err=f"{r['rel_error']:.4f}") for r in rows]
        if show:
            print(table(show, [("candidate", "cand"), ("level", "lvl"), ("dim", "dim"),
                               ("ops", "ops"), ("n", "n"), ("sim", "sim MiB"),
                               ("meas", "measured MiB"), ("err", "rel err"),
                               ("ratio", "vs unsplit"), ("allclose", "allclose"),
                               ("allclose_fp64", "fp64")]), flush=True)
    write_json(a.json, all_rows)
    bad = [r for r in all_rows if r["rel_error"] > 0.03
           or not (r["allclose"] or r["allclose_fp64"])]
    print(f"{len(all_rows)} split programs, {len(bad)} failing")
    return 1 if bad else 0
