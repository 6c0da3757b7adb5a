"""One Pareto plot per model: measured peak vs measured step time (as a ratio to
eager timed in the same process) of every strategy."""
from __future__ import annotations

import os

from .peers_harness import Result, pareto

STYLE = {"eager": ("k", "o"), "checkpoint": ("tab:blue", "s"), "compile": ("tab:orange", "^"),
         "rockmate": ("tab:purple", "v"), "magis": ("tab:green", "D"),
         "magis+inductor": ("tab:red", "P")}
OURS = ("magis", "magis+inductor")


def plot_model(results: list[Result], model: str, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.model == model and r.peak and r.time_ratio]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for strat, (color, marker) in STYLE.items():
        pts = [r for r in rows if r.strategy == strat]
        if not pts:
            continue
        ax.scatter([r.time_ratio for r in pts], [r.peak / 2**20 for r in pts], c=color, marker=marker,
                   label=strat, s=40, zorder=3)
        if strat == "compile":
            for r in pts:
                ax.annotate(r.setting.removeprefix("budget="), (r.time_ratio, r.peak / 2**20),
                            textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    front = pareto([(r.peak, r.time_ratio) for r in rows if r.strategy in OURS])
    if front:
        ax.step([t for _, t in front], [p / 2**20 for p, _ in front], where="post",
                c="tab:green", lw=1, alpha=0.6)
    ax.set_xlabel("step time / eager step time (median, timed side by side, 2 threads)")
    ax.set_ylabel("peak memory, MiB")
    ax.set_title(f"{model}: peak vs time per training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
