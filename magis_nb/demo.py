"""The main job, headless: capture a zoo model's training step, run the generated
program, and print the simulated next to the measured peak (and eager's); then
split the F-Tree's best region and print the same for the split program.

    python -m magis_nb.demo [--model gpt] [--size tiny]
"""
from __future__ import annotations

import argparse
import sys

import torch

from . import zoo
from .analysis import DGraph, apply_fission, build_ftree
from .program import trace
from .verify import check_step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m magis_nb.demo", description=__doc__)
    p.add_argument("--model", default="gpt", choices=zoo.names("tiny"))
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    case = zoo.build(a.model, "tiny")
    print(f"model: {case.description}")
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn)
    s = prog.graph.summary()
    print(f"captured {s['ops']} ATen ops in {prog.captured.seconds:.2f} s")
    sim = prog.simulate()
    chk = check_step(case.model, case.inputs, case.loss_fn, "train", lambda m: prog.module())
    mib = 2**20
    rows = [("simulated peak (program order)", sim.peak),
            ("measured peak (generated program)", chk.measured_peak),
            ("measured peak (eager PyTorch)", chk.eager_peak),
            ("weights + inputs (resident)", prog.memgraph.resident_bytes)]
    w = max(len(r[0]) for r in rows)
    for label, b in rows:
        print(f"{label:<{w}}  {b / mib:8.2f} MiB")
    err = abs(sim.peak - chk.measured_peak) / chk.measured_peak
    print(f"simulated vs measured: {100 * err:.2f}% apart; "
          f"loss/grads/buffers allclose to eager: {chk.comparison.allclose}")
    ok = chk.comparison.allclose and err <= 0.03

    # The F-Tree's highest-scoring region, split into 4 parts.
    dg = DGraph(prog.graph)
    cands = build_ftree(dg, prog.hotspots())
    if cands:
        best = max(cands, key=lambda c: c.score)
        n = 4 if best.max_n % 4 == 0 else best.max_n
        split = prog.with_graph(apply_fission(dg, [best.ftrans(n)]))
        fchk = check_step(case.model, case.inputs, case.loss_fn, "train", lambda m: split.module())
        comp = dg.components[best.comp]
        print(f"\nfission: {len(cands)} F-Tree candidates; the best splits {len(best.ops)} ops "
              f"along {comp.name} (length {comp.size}) into {n} parts")
        for label, b in [("simulated peak (split)", split.simulate().peak),
                         ("measured peak (split)", fchk.measured_peak)]:
            print(f"{label:<{w}}  {b / mib:8.2f} MiB  ({b / chk.measured_peak:.2f} x unsplit)")
        print(f"loss/grads/buffers allclose to eager: {fchk.comparison.allclose}")
        ok = ok and fchk.comparison.allclose
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
