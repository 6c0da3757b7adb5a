"""Small shared pieces of the benchmark commands."""
from __future__ import annotations

import argparse
import json
import os

import torch


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m magis_nb.bench {prog}", description=doc)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def write_json(path: str | None, obj) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=2)
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
