"""The README's main job: run notebooks/01_quickstart.ipynb headlessly, print its table.

    python -m magis_nb.notebook.run_quickstart [--out DIR]

Executes the notebook top to bottom in a fresh kernel (nbclient), then prints what
its cells tagged ``summary`` printed: the before/after table and the training
steps compared with eager PyTorch. The executed notebook is written to DIR
(default out/notebooks) to open in Jupyter.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .run import NOTEBOOKS, cell_text, execute


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m magis_nb.notebook.run_quickstart")
    ap.add_argument("--out", type=Path, default=Path("out/notebooks"))
    args = ap.parse_args(argv)
    path = NOTEBOOKS / "01_quickstart.ipynb"
    t0 = time.perf_counter()
    nb = execute(path, args.out)
    print(f"{path.name} ran in {time.perf_counter() - t0:.1f} s; executed copy: "
          f"{args.out / path.name}\n")
    for cell in nb.cells:
        if "summary" in cell.get("metadata", {}).get("tags", []):
            print(cell_text(cell))
    return 0


if __name__ == "__main__":
    sys.exit(main())
