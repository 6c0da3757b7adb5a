"""The result as HTML (``OptimizeResult._repr_html_``) and as a plain-text table."""
from __future__ import annotations

from html import escape

from ..search.result import OptimizeResult, Plan

MiB = 2**20
LIST_SHOWN = 12   # names listed inline; the rest folds into <details>


def _mib(b: float) -> str:
    return f"{b / MiB:,.2f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms"


def budget_text(r: OptimizeResult) -> str:
    if r.budget_kind == "mem":
        return f"memory ≤ {_mib(r.budget)} (x{r.budget_ratio:.2f} of the unoptimized peak)"
    if r.budget_kind == "lat":
        return f"latency ≤ {_ms(r.budget)} (x{r.budget_ratio:.2f} of the unoptimized step)"
    return "none: lowest peak within 10% of the unoptimized latency"


def _names(items: list[str]) -> str:
    if not items:
        return "none"
    head = ", ".join(f"<code>{escape(x)}</code>" for x in items[:LIST_SHOWN])
    if len(items) <= LIST_SHOWN:
        return f"{len(items)}: {head}"
    rest = ", ".join(f"<code>{escape(x)}</code>" for x in items[LIST_SHOWN:])
    return (f"{len(items)}: {head} <details style='display:inline'><summary>"
            f"{len(items) - LIST_SHOWN} more</summary>{rest}</details>")


def _fission(plan: Plan) -> str:
    if not plan.fission:
        return "none"
    rows = "".join(
        f"<tr><td><code>{escape(r.dim)}</code></td><td>{r.n}</td><td>{r.ops}</td>"
        f"<td><code>{escape(r.first)}</code></td><td>{'yes' if r.packed else 'no'}</td></tr>"
        for r in plan.fission)
    return ("<table><tr><th>split dim</th><th>parts n</th><th>ops</th><th>starts at</th>"
            f"<th>dropout masks packed</th></tr>{rows}</table>")


def result_html(r: OptimizeResult) -> str:
    b, a = r.before, r.plan
    status = "met" if r.met else "<b style='color:#c44e52'>not met</b>"
    note = " (interrupted: best plan so far)" if r.interrupted else ""
    rows = [
        ("budget", f"{escape(budget_text(r))} — {status}"),
        ("peak memory", f"{_mib(b.peak)} → <b>{_mib(a.peak)}</b> (x{r.mem_ratio:.3f})"),
        ("step latency", f"{_ms(b.latency)} → <b>{_ms(a.latency)}</b> (x{r.lat_ratio:.3f}, "
                         f"cost model: {escape(r.profile)})"),
        ("fission", _fission(a)),
        ("re-materialized ops", _names(a.remat)),
        ("swapped to host", _names(a.swaps)),
        ("search", f"{r.seconds:.1f} s, {r.states:,} states, {len(r.pareto)} Pareto plans{note}"
                   + _phases(r)),
    ]
    body = "".join(f"<tr><th style='text-align:left;vertical-align:top'>{k}</th>"
                   f"<td style='text-align:left'>{v}</td></tr>" for k, v in rows)
    return (f"<div class='magis-result'><p><b>MAGIS</b> ({escape(r.mode)}): "
            f"{escape(r.message)}</p><table>{body}</table></div>")


def _phases(r: OptimizeResult) -> str:
    t = r.timings
    if not t:
        return ""
    return (f" (capture {t['capture']:.1f} s, analysis {t['analysis']:.1f} s, "
            f"search {t['search']:.1f} s)")


def summary_table(r: OptimizeResult) -> str:
    """Before/after as a Markdown table (prints well in a terminal too)."""
    lines = ["| plan | peak MiB | x peak | latency ms | x latency | applied |",
             "|---|---|---|---|---|---|"]
    for row in r.summary():
        p = r.before if row["plan"] == "before" else r.plan
        lines.append(f"| {row['plan']} | {row['peak_MiB']:.2f} | {p.peak / r.before.peak:.3f} "
                     f"| {row['latency_ms']:.3f} | {p.latency / r.before.latency:.3f} "
                     f"| {row['applied']} |")
    return "\n".join(lines)
