"""Memory timeline and Pareto figures.

Figures are built with `matplotlib.figure.Figure`, never pyplot: nothing is
registered with a pyplot backend, so the inline backend cannot show a figure a
second time at the end of the cell and no figure outlives its PNG (the "display
once, close" rule, without relying on the user's backend). Works under Agg.
"""
from __future__ import annotations

import io

from ..search.result import OptimizeResult, Plan, Timeline

MiB = 2**20
COLORS = {"weight": "#4c72b0", "activation": "#dd8452", "gradient": "#55a868",
          "input": "#937860", "loss": "#8172b3", "buffer": "#da8bc3", "other": "#8c8c8c"}
HOST = "#c44e52"
FALLBACK = ["#64b5cd", "#ccb974", "#8c613c", "#b07aa1"]


def _figure(w: float, h: float, ncols: int = 1):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=90, layout="constrained")
    axes = fig.subplots(1, ncols, sharey=True, squeeze=False)[0]
    return fig, list(axes)


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _color(cat: str, i: int) -> str:
    return COLORS.get(cat, FALLBACK[i % len(FALLBACK)])


def draw_timeline(ax, tl: Timeline, title: str, budget: int | None, ylim: tuple | None):
    """Device memory stacked by category above zero, host-parked bytes below it."""
    steps = range(tl.steps)
    cats = list(tl.by_category)
    ys = [[b / MiB for b in tl.by_category[c]] for c in cats]
    if steps:
        ax.stackplot(steps, *ys, labels=cats, colors=[_color(c, i) for i, c in enumerate(cats)],
                     step="post", alpha=0.9, linewidth=0)
        if any(tl.host):
            ax.fill_between(steps, [-h / MiB for h in tl.host], 0, step="post", color=HOST,
                            alpha=0.5, hatch="//", linewidth=0, label="swapped to host (below 0)")
            ax.axhline(0, color="black", linewidth=0.6)
    for k, (a, b, label) in enumerate(tl.regions):
        ax.axvspan(a, b + 1, color="#999999", alpha=0.15,
                   label="fission region" if k == 0 else None)
        ax.text((a + b + 1) / 2, 0.98, label, transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=7, color="#444444")
    if budget:
        ax.axhline(budget / MiB, color="black", linestyle="--", linewidth=1,
                   label=f"budget {budget / MiB:.1f} MiB")
    ax.plot([tl.peak_step], [tl.peak / MiB], marker="v", color="crimson", markersize=8,
            linestyle="none", label="peak")
    ax.annotate(f"peak {tl.peak / MiB:.2f} MiB", (tl.peak_step, tl.peak / MiB),
                textcoords="offset points", xytext=(4, 4), fontsize=8, color="crimson")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step (op in schedule order)")
    ax.set_xlim(0, max(tl.steps, 1))
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)


def _budget_bytes(result: OptimizeResult) -> int | None:
    return int(result.budget) if result.budget_kind == "mem" and result.budget else None


def timeline_figure(result: OptimizeResult, plan: Plan | None = None, before: bool = True):
    """Before and after (or only after) memory timelines on one y scale."""
    plan = plan or result.plan
    after = result.timeline(plan)
    panels = [(result.timeline(result.before), "before (PyTorch order)")] if before else []
    panels.append((after, f"after: {plan.applied}"))
    top = max(t.peak for t, _ in panels) / MiB * 1.12
    budget = _budget_bytes(result)
    if budget:
        top = max(top, budget / MiB * 1.08)
    host = max((max(t.host, default=0) for t, _ in panels), default=0) / MiB
    fig, axes = _figure(12 if before else 8, 3.6, len(panels))
    for ax, (tl, title) in zip(axes, panels):
        draw_timeline(ax, tl, title, budget, (-host * 1.15, top))
    axes[0].set_ylabel("device memory, MiB")
    legend: dict = {}
    for ax in axes:   # one legend for both panels, beside them: it hides no data
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    fig.legend(list(legend.values()), list(legend), loc="outside right upper", fontsize=7)
    return fig


def pareto_figure(result: OptimizeResult, plan: Plan | None = None):
    """Peak vs latency of every recorded plan: the front, PyTorch's plan, the choice."""
    plan = plan or result.plan
    fig, (ax,) = _figure(5.5, 3.6)
    front = sorted(result.pareto, key=lambda p: p.peak)
    ax.step([p.peak / MiB for p in front], [p.latency * 1e3 for p in front], where="post",
            color="#4c72b0", alpha=0.5)
    ax.scatter([p.peak / MiB for p in front], [p.latency * 1e3 for p in front], s=18,
               color="#4c72b0", label=f"Pareto front ({len(front)} plans)", zorder=3)
    b = result.before
    ax.scatter([b.peak / MiB], [b.latency * 1e3], marker="x", s=60, color="black",
               label="before (PyTorch)", zorder=4)
    ax.scatter([plan.peak / MiB], [plan.latency * 1e3], marker="*", s=180, color="crimson",
               label="chosen", zorder=5)
    # plans timed here (Note [measured at the front door]): their measured step
    timed = [(p, result.times[id(p)]) for p in [b] + front + [plan] if id(p) in result.times]
    if timed:
        ax.scatter([p.peak / MiB for p, _ in timed], [t.step_s * 1e3 for _, t in timed],
                   s=40, facecolors="none", edgecolors="#dd8452", zorder=6,
                   label="measured step (timed here)")
    eager_s = next((t.ref_s for _, t in timed if t.ref_s), None)
    if result.budget_kind == "mem" and result.budget:
        ax.axvline(result.budget / MiB, color="black", linestyle="--", linewidth=1,
                   label="memory budget")
    elif result.budget_kind == "lat" and result.budget:
        # a measured budget is of eager's step; a simulated one of the captured program's
        at, what = ((result.budget_ratio * eager_s, "latency budget (of eager, measured)")
                    if result.fits and eager_s else (result.budget, "latency budget (simulated)"))
        ax.axhline(at * 1e3, color="black", linestyle="--", linewidth=1, label=what)
    ax.set_xlabel("peak device memory, MiB (simulated)")
    ax.set_ylabel(f"step latency, ms (dots: simulated, {result.profile})")
    ax.set_title("memory vs latency", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def show_png(fig, text: str) -> None:
    """Display a figure once as PNG (text/plain for terminals) and let it go."""
    from IPython.display import display
    display({"image/png": png(fig), "text/plain": text}, raw=True)
    fig.clear()
