"""Execute tutorial notebooks headlessly (nbclient), as CI and the README do.

    python -m magis_nb.notebook.run                 # every notebooks/*.ipynb
    python -m magis_nb.notebook.run notebooks/02_budget_slider.ipynb --out out/nb

Each notebook runs top to bottom in a fresh kernel of this Python; widget state is
saved into the executed copy. Exit status 1 if any cell raised (cells tagged
``raises-exception`` are allowed to).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
TIMEOUT_S = 600


def notebook_paths(names: list[str] | None = None) -> list[Path]:
    if names:
        return [Path(n) for n in names]
    return sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))


def execute(path: Path, out_dir: Path | None = None, timeout: int = TIMEOUT_S):
    """Run one notebook; return the executed notebook (raises CellExecutionError)."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    # The kernel runs in the notebook's folder (relative paths work) on the CPU with
    # the interpreter running this, whatever "python" is on PATH.
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}},
                            store_widget_state=True,
                            # a local kernel on loopback: its TCP-without-encryption warning is noise
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("MPLBACKEND", "Agg")
    try:
        client.execute(env=env)
    finally:
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, out_dir / path.name)
    return nb


def cell_text(cell) -> str:
    """The text a cell printed (stream outputs), as a terminal would show it."""
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o["output_type"] == "stream")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m magis_nb.notebook.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", help="default: notebooks/[0-9]*.ipynb")
    ap.add_argument("--out", type=Path, help="write executed copies here")
    ap.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per cell")
    args = ap.parse_args(argv)
    failed = 0
    for path in notebook_paths(args.notebooks):
        t0 = time.perf_counter()
        try:
            execute(path, args.out, args.timeout)
            status = "ok"
        except Exception as e:  # report every notebook, then fail
            failed += 1
            status = f"FAILED: {type(e).__name__}: {str(e)[-2000:]}"
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s {status}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
