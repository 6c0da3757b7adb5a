"""python -m magis_nb.bench <command> [options]; see each command's --help."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "simcheck": "simulated vs measured peak and eager equality of every tiny zoo model",
    "capture": "capture every paper-size zoo model on fake tensors (time, peak RSS)",
    "sched": "DP / incremental scheduling against program order",
    "fission": "F-Tree candidates of every tiny zoo model, split, measured, checked",
    "optimize": "the optimizer under memory/latency budgets (CPU measured; paper sizes simulated)",
    "peers": "magis_nb against eager, checkpoint, torch.compile memory budgets, Rockmate (CPU)",
    "overhead": "the generated program against PyTorch before any rewrite (time ratio, ops)",
    "corpus": "real architectures (HF transformers, torch.nn), small and random: optimize, check, peaks",
    "longctx": "causal LMs at 1-8x the sequence length in eager's memory at 1x, against peers",
    "tiles": "U-Net inference on a large image, planned into tiles with halos (CPU)",
    "ddp": "data parallel (2 gloo ranks): magis_nb's bucketed plans against DDP eager",
    "latency": "simulated plan latency against the measured step (ratios, the ops furthest off)",
    "gpu": "the one-shot GPU check: GPU tests, simcheck, eager vs plans, hidden transfers",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        for k, v in COMMANDS.items():
            print(f"  {k:10s} {v}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    mod = importlib.import_module(f"magis_nb.bench.{argv[0]}")
    return mod.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
