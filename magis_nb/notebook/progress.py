"""Live search progress: an ipywidgets line in Jupyter, a tqdm bar in a terminal.

``optimize`` calls the reporter several times a second and once with done=True;
redraws are throttled so a fast search does not flood the kernel's output channel.
"""
from __future__ import annotations

import time
from html import escape

from ..search.result import Progress

MiB = 2**20
REDRAW_S = 0.2


def in_kernel(shell) -> bool:
    """True under a Jupyter kernel (widgets render); False in terminal IPython."""
    return type(shell).__name__ == "ZMQInteractiveShell"


def describe(p: Progress) -> str:
    return (f"{p.states} states · best peak {p.best_peak / MiB:.2f} MiB "
            f"(x{p.best_peak / max(p.before_peak, 1):.2f}) · latency "
            f"{p.best_latency * 1e3:.3f} ms (x{p.best_latency / max(p.before_latency, 1e-12):.2f})")


class _Throttled:
    def __init__(self):
        self._last = 0.0
        self.calls = 0

    def __call__(self, p: Progress):
        self.calls += 1
        now = time.monotonic()
        if p.done or now - self._last >= REDRAW_S:
            self._last = now
            self.draw(p)

    def close(self, failed: str | None = None) -> None:
        """After the search: mark a failure (the done report never came)."""


class WidgetProgress(_Throttled):
    """Elapsed of the time budget as a bar, the search's best plan so far beside it."""

    def __init__(self, time_budget: float, label: str):
        super().__init__()
        import ipywidgets as w
        from IPython.display import display
        self.bar = w.FloatProgress(value=0.0, min=0.0, max=float(time_budget),
                                   description="searching", bar_style="info",
                                   layout=w.Layout(width="320px"))
        self.text = w.HTML(value=f"<code>{label}</code>: starting…")
        self.label = label
        self.box = w.HBox([self.bar, self.text])
        display(self.box)

    def draw(self, p: Progress):
        self.bar.max = float(p.time_budget)
        self.bar.value = min(float(p.elapsed), float(p.time_budget))
        head = f"{p.elapsed:.1f} / {p.time_budget:.0f} s"
        if p.done:
            self.bar.description = "done"
            self.bar.bar_style = "success"
            self.bar.value = self.bar.max
        self.text.value = f"<code>{self.label}</code>: {head} · {describe(p)}"

    def close(self, failed: str | None = None) -> None:
        if failed:
            self.bar.bar_style = "danger"
            self.bar.description = "failed"
            self.text.value = f"<code>{self.label}</code>: {escape(failed)}"


class TqdmProgress(_Throttled):
    """Terminal IPython: a text bar over the time budget (seconds)."""

    def __init__(self, time_budget: float, label: str):
        super().__init__()
        from tqdm.std import tqdm  # the text bar: tqdm.auto could pick a widget
        self.bar = tqdm(total=round(float(time_budget), 1), desc=f"magis {label}",
                        unit="s", bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                        "{n:.1f}/{total:.0f} s{postfix}", leave=True)

    def draw(self, p: Progress):
        self.bar.n = round(min(p.elapsed, p.time_budget), 1)
        self.bar.set_postfix_str(describe(p), refresh=False)
        self.bar.refresh()
        if p.done:
            self.bar.close()

    def close(self, failed: str | None = None) -> None:
        if failed:
            self.bar.set_postfix_str(f"failed: {failed}", refresh=False)
        self.bar.close()


def reporter(shell, quiet: bool, time_budget: float, label: str):
    """The progress callable for ``optimize`` (None when quiet)."""
    if quiet:
        return None
    if in_kernel(shell):
        return WidgetProgress(time_budget, label)
    return TqdmProgress(time_budget, label)
