"""Small shared pieces of the benchmark commands."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m magis_nb.bench {prog}", description=doc)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def write_json(path: str | None, obj, quiet: bool = False) -> None:
    """``obj`` as JSON at ``path`` (nothing when None); ``quiet``: without saying
    so (a long run writing its partial results after every model)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=2)
        if not quiet:
            print(f"wrote {path}")


def fixed_threads(n: int = 2) -> None:
    """Same thread count for every measurement (timings are comparable)."""
    torch.set_num_threads(n)


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    """Plain-text table: cols are (key, header)."""
    cells = [[h for _, h in cols]] + [[str(r.get(k, "")) for k, _ in cols] for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c[i].rjust(w[i]) for i in range(len(cols))) for c in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


# -- one model per process ---------------------------------------------------------------
# A bench that runs each model (or strategy) in a fresh process: the parent calls
# `run_child`, the child (the same command with its own arguments, e.g. --one) ends
# with `send_result`. A crash or a timeout costs that one row, not the run.

RESULT = "MAGIS_NB_RESULT "


def send_result(obj) -> None:
    """In the child: hand ``obj`` to `run_child` as one JSON line on stdout."""
    print(RESULT + json.dumps(obj, default=str), flush=True)


@dataclass
class ChildResult:
    value: object = None      # what the child sent (None when it sent nothing)
    error: str | None = None  # why not: "timed out after N s", or the child's last stderr line
    timed_out: bool = False
    returncode: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def run_child(command: str, args: list[str], timeout: float | None = None) -> ChildResult:
    """``python -m magis_nb.bench COMMAND ARGS`` in a fresh process: the last value
    it sent (`send_result`), or why it sent none."""
    cmd = [sys.executable, "-m", "magis_nb.bench", command, *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return ChildResult(error=f"timed out after {timeout:g} s", timed_out=True,
                           seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT):
            return ChildResult(json.loads(line[len(RESULT):]), returncode=p.returncode, seconds=seconds)
    tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    return ChildResult(error=tail[-1] if tail else f"exit status {p.returncode}",
                       returncode=p.returncode, seconds=seconds)
