"""The result in words: HTML (``OptimizeResult._repr_html_``), a plain-text
table, and which kind of memory its numbers are (Note [which memory])."""
from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from ..simulate.profiles import PROFILES
from .measured_choice import SLOW

if TYPE_CHECKING:
    from .result import OptimizeResult, Plan

MiB = 2**20
LIST_SHOWN = 12   # names listed inline; the rest folds into <details>


def _mib(b: float) -> str:
    return f"{b / MiB:,.2f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms"


# Note [which memory]
# A plan's peak is the simulated peak of the device that runs the step. What
# that means to the user depends on where the step runs and what it was planned
# for. On the CPU, host and "device" memory are the same RAM: a swap moves bytes
# from one tensor of the process to another and saves nothing, so a CPU plan
# (no GPU profile named) has no swaps by default and its peak is the process's
# memory. A plan for a GPU profile made on a CPU machine is measured here as a
# stand-in for the device: its swapped bytes live in host buffers the stand-in
# does not count, and the report says so.
def _gpu_planned(r: OptimizeResult) -> str | None:
    """The GPU profile's display name when the plan was made for one, else None
    (a profile says itself whether it is a GPU: `DeviceProfile.gpu`)."""
    p = PROFILES.get(r.profile.split(":")[-1])
    return p.title if p is not None and p.gpu else None


def _process_plan(r: OptimizeResult) -> bool:
    """A CPU plan without swaps: its peaks are the process's memory."""
    return r.device == "cpu" and _gpu_planned(r) is None and not r.swap


def memory_kind(r: OptimizeResult) -> str:
    """One sentence: which memory the result's peaks are (Note [which memory])."""
    gpu = _gpu_planned(r)
    if r.device == "cuda":
        return "planned for this GPU: device memory; swapped bytes live in host memory"
    if gpu is not None:
        return (f"planned for {gpu}; device memory measured here as a stand-in, "
                "swapped bytes live in host memory")
    if r.swap:
        return ("planned for this CPU with swaps allowed: the peak is a stand-in device's; "
                "swapped bytes stay in the same RAM, so the process saves less than it shows")
    return ("planned for this CPU: process memory (no swaps: host and device memory "
            "are the same RAM here)")


def peak_ratios(res: OptimizeResult, peak: int) -> str:
    """``peak`` as a ratio of eager's measured step, and of the captured program
    where the two differ by more than 1% (Note [the budget's baseline])."""
    if res.eager_peak is None:
        return f"{peak / res.before.peak:.2f}x of the captured program, simulated"
    out = f"{peak / res.eager_peak:.2f}x of eager's step"
    if abs(res.before.peak - res.eager_peak) > 0.01 * res.eager_peak:
        out += f", {peak / res.before.peak:.2f}x of the captured program"
    return out


def measured_text(r: OptimizeResult) -> str | None:
    """The chosen plan's measured peak next to eager PyTorch's, in words, or None
    when the plan was not run (``verify=False``, or the meta device)."""
    m = r.measured
    if m is None:
        return None
    if _process_plan(r):
        return (f"measured process memory of one step: eager PyTorch {_mib(m.eager_peak)}, "
                f"plan {_mib(m.process_peak)} (x{m.process_peak / m.eager_peak:.3f})")
    host = f", plus {_mib(m.host_bytes)} of host buffers" if m.host_bytes else ""
    return (f"measured on this machine (stand-in device memory of one step): eager PyTorch "
            f"{_mib(m.eager_peak)}, plan {_mib(m.peak)} (x{m.peak / m.eager_peak:.3f}){host}")


def time_text(r: OptimizeResult) -> str:
    """The chosen plan's step time in words: measured against eager's where it
    was timed, else why the latency shown is simulated only."""
    t = r.measured_time
    sim = f"simulated x{r.lat_ratio:.3f} of the captured program's"
    if t is not None:
        q1, q3 = t.quartiles
        slow = (f" — SLOW: {t.ratio:.1f} times eager's step" if t.ratio > SLOW else "")
        return (f"measured x{t.ratio:.3f} of eager PyTorch's step (quartiles {q1:.3f}-{q3:.3f}, "
                f"{len(t.ratios)} interleaved pairs){slow}; {sim}")
    if r.device == "meta" or r.eager_peak is None:
        why = "the step was not run here (the meta device, or verify=False)"
    elif r.timer is None and not r.profile.startswith("measured"):
        why = f"planned for {r.profile}, not timed on this machine"
    else:
        why = "not timed (measure_time=False)"
    return f"{sim}, simulated only: {why}"


def loss_text(r: OptimizeResult) -> str:
    """Which of the model's outputs the step trains on (`capture.outputs.locate_loss`)."""
    return (f"loss: the model's {r.loss_at}, the scalar its output holds; the optimized "
            "module returns that loss")


def budget_text(r: OptimizeResult) -> str:
    if r.budget_kind == "mem":
        of = ("eager PyTorch's measured step" if r.eager_peak is not None
              else "the captured program's simulated peak")
        return f"memory ≤ {_mib(r.budget)} (x{r.budget_ratio:.2f} of {of})"
    of = ("eager PyTorch's measured step" if r.fits and r.measured_time is not None
          else "the captured program's simulated step")
    if r.budget_kind == "lat":
        return f"latency ≤ x{r.budget_ratio:.2f} of {of}"
    return f"none: lowest peak within 10% of {of}"


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
    measured = measured_text(r)
    status = "met" if r.met else "<b style='color:#c44e52'>not met</b>"
    note = " (interrupted: best plan so far)" if r.interrupted else ""
    if r.too_big:
        note += (f"; {r.too_big} bigger plan(s) not tried: they would have ended past "
                 "time_budget (a longer search may go lower)")
    rows = [
        ("budget", f"{escape(budget_text(r))} — {status}"),
        ("peak memory", f"{_mib(b.peak)} → <b>{_mib(a.peak)}</b> (x{r.mem_ratio:.3f}, "
                        f"simulated; {escape(memory_kind(r))})"),
        *([("measured", escape(measured))] if measured else []),
        ("step time", f"<b>{escape(time_text(r))}</b>"),
        *([("loss", escape(loss_text(r)))] if r.loss_at else []),
        ("simulated latency", f"{_ms(b.latency)} → {_ms(a.latency)} (x{r.lat_ratio:.3f}, "
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
    lines = ["| plan | peak MiB | x peak | sim. latency ms | sim. x latency | measured x time "
             "| applied |", "|---|---|---|---|---|---|---|"]
    ref = r.reference_peak
    timed = r.measured_time is not None
    if r.eager_peak is not None:
        lines.append(f"| eager | {r.eager_peak / 2**20:.2f} | 1.000 | | | "
                     f"{'1.000' if timed else ''} | measured: PyTorch as you run it |")
    for row in r.summary():
        p = r.before if row["plan"] == "before" else r.plan
        t = row["measured_time_ratio"]
        lines.append(f"| {row['plan']} | {row['peak_MiB']:.2f} | {p.peak / ref:.3f} "
                     f"| {row['latency_ms']:.3f} | {p.latency / r.before.latency:.3f} "
                     f"| {f'{t:.3f}' if t is not None else ''} | {row['applied']} |")
    of = "eager's measured step" if r.eager_peak is not None else "the captured program"
    lines.append(f"\nplan peaks are simulated, x peak is of {of}; sim. latencies are "
                 "simulated, of the captured program's; measured x time is a plan's step "
                 "over eager's, timed here (median of interleaved pairs); "
                 f"{memory_kind(r)}")
    lines.append(f"step time: {time_text(r)}")
    if r.loss_at:
        lines.append(loss_text(r))
    measured = measured_text(r)
    if measured:
        lines.append(measured)
    return "\n".join(lines)
