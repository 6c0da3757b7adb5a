"""tiles: large-image inference of a U-Net, planned by the search into tiles.

The zoo's U-Net (BatchNorm, eval mode: its statistics are fixed, so batch norm
is elementwise) at --base channels and --depth levels, one image of --sizes
pixels square, `mode="infer"`; ``--volume``: the same U-Net in three dimensions
(``UNet(dims=3)``: Conv3d, BatchNorm3d, MaxPool3d, ConvTranspose3d) on one
one-channel volume of --sizes voxels a side, as in medical image segmentation. For each size: eager's step, and the plan the
search finds for ``mem_budget=--budget`` (a ratio of eager's simulated peak;
swap off: on the CPU host and device memory are the same RAM). The search
reaches tiles through the F-Tree's spatial candidates (Note [tiles with halos]
in analysis/spatial.py); nothing here places a region.

Peaks are process memory measured around one call (`verify.Reference`:
weights and input live before it, plus the call's peak); the plan's is checked
against its simulated peak and its output against eager's (allclose). Times
are medians of --reps calls, eager's and the plan's interleaved.

JSON rows: size, weights (bytes), eager_peak, plan_peak, plan_sim, mem_ratio
(plan_peak / eager_peak), lat_ratio, allclose, applied, met, search_s.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..zoo.unet import UNet
from .common import fixed_threads, parser, table, write_json


def _timed(fn) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        fn()
    return time.perf_counter() - t0


def run_size(size: int, base: int, depth: int, budget: float, time_budget: float,
             reps: int, volume: bool = False) -> dict:
    from ..search import optimize
    from ..verify import Reference

    torch.manual_seed(0)
    if volume:
        model = UNet(base, depth, 2, in_ch=1, dims=3).eval()
        x = torch.randn(1, 1, size, size, size)
    else:
        model = UNet(base, depth, 2).eval()
        x = torch.randn(1, 3, size, size)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ref = Reference(model, (x,), None, "infer", 0)
    t0 = time.perf_counter()
    res = optimize(model, (x,), mode="infer", mem_budget=budget, time_budget=time_budget,
                   swap=False)
    search_s = time.perf_counter() - t0
    mod = res.module
    chk = ref.check(mod)
    te, tp = [], []
    for _ in range(reps):
        te.append(_timed(lambda: model(x)))
        tp.append(_timed(lambda: mod(x)))
    row = {
        "model": "unet3d" if volume else "unet", "size": size, "weights": weights, "eager_peak": ref.eager_peak,
        "plan_peak": chk.measured_peak, "plan_sim": res.plan.peak,
        "mem_ratio": round(chk.measured_peak / ref.eager_peak, 3),
        "lat_ratio": round(statistics.median(tp) / statistics.median(te), 2),
        "eager_s": round(statistics.median(te), 2), "allclose": chk.comparison.allclose,
        "applied": res.plan.applied, "met": res.met, "search_s": round(search_s, 1)}
    print(f"{row['model']} {size}: eager {row['eager_peak'] / 2**20:.1f} MiB, plan "
          f"{row['plan_peak'] / 2**20:.1f} MiB (x{row['mem_ratio']}), time x{row['lat_ratio']}, "
          f"{row['applied']}", flush=True)
    return row


def main(argv) -> int:
    p = parser("tiles", __doc__)
    p.add_argument("--sizes", default="2048", help="image sides, comma separated")
    p.add_argument("--base", type=int, default=8)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--budget", type=float, default=0.2, help="mem_budget (ratio of eager's peak)")
    p.add_argument("--time", type=float, default=90.0, help="search seconds per size")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--volume", action="store_true", help="a 3-D U-Net on a volume")
    a = p.parse_args(argv)
    fixed_threads()
    rows = [run_size(int(s), a.base, a.depth, a.budget, a.time, a.reps, a.volume)
            for s in a.sizes.split(",")]
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    show = [dict(r, w=mib(r["weights"]), e=mib(r["eager_peak"]), pl=mib(r["plan_peak"]),
                 sim=mib(r["plan_sim"])) for r in rows]
    print(table(show, [("model", "model"), ("size", "side"), ("w", "weights MiB"), ("e", "eager MiB"),
                       ("pl", "plan MiB"), ("sim", "simulated MiB"), ("mem_ratio", "plan/eager"),
                       ("lat_ratio", "time ratio"), ("eager_s", "eager s"),
                       ("allclose", "allclose"), ("applied", "applied")]))
    print("peaks: process memory (weights and input + the call's measured peak)")
    write_json(a.json, rows)
    return 0 if all(r["allclose"] and r["plan_peak"] == r["plan_sim"] for r in rows) else 1


if __name__ == "__main__":   # pragma: no cover
    raise SystemExit(main(__import__("sys").argv[1:]))
