"""tiles: large-image inference of a U-Net, planned by the search into tiles.

The zoo's U-Net (BatchNorm, eval mode: its statistics are fixed, so batch norm
is elementwise) at --base channels and --depth levels, one image of --sizes
pixels square, `mode="infer"`; ``--volume``: a 3-D U-Net of the same layout
(Conv3d, BatchNorm3d, MaxPool3d, ConvTranspose3d) on one volume of --sizes
voxels a side, as in medical image segmentation. For each size: eager's step, and the plan the
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

from torch import nn

from ..zoo.unet import UNet
from .common import fixed_threads, parser, table, write_json


class UNet3d(nn.Module):
    """The zoo U-Net's layout in three dimensions (no zoo model: volumes are
    where tiles matter most, and nothing else here is 3-D)."""

    def __init__(self, base: int, depth: int, classes: int, in_ch: int = 1):
        super().__init__()

        def double(a, b):
            return nn.Sequential(nn.Conv3d(a, b, 3, padding=1, bias=False), nn.BatchNorm3d(b),
                                 nn.ReLU(), nn.Conv3d(b, b, 3, padding=1, bias=False),
                                 nn.BatchNorm3d(b), nn.ReLU())
        ch = [base * 2**i for i in range(depth + 1)]
        self.inc = double(in_ch, ch[0])
        self.down = nn.ModuleList(nn.Sequential(nn.MaxPool3d(2), double(ch[i], ch[i + 1]))
                                  for i in range(depth))
        self.up = nn.ModuleList(nn.ConvTranspose3d(ch[i + 1], ch[i], 2, stride=2)
                                for i in reversed(range(depth)))
        self.dec = nn.ModuleList(double(2 * ch[i], ch[i]) for i in reversed(range(depth)))
        self.outc = nn.Conv3d(ch[0], classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([skips.pop(), up(x)], 1))
        return self.outc(x)


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
        model = UNet3d(base, depth, 2).eval()
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
