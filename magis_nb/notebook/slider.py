"""Budget slider: pick another recorded Pareto plan by memory budget, live.

Moving the slider (value = ratio of the unoptimized peak) calls `Session.reselect`,
which re-binds the module in the namespace, then redraws the after-timeline and the
status line. ``continuous_update=False``: one re-selection per release, not one per
pixel dragged (each may build a module).
"""
from __future__ import annotations

import math
from html import escape

from ..search.measured_choice import SLOW
from .session import Session

MiB = 2**20


def _status(s: Session) -> str:
    r, p = s.result, s.result.plan
    met = "" if r.met else " <b style='color:#c44e52'>(budget not met: lowest plan shown)</b>"
    t = r.measured_time
    time = (f"step measured <b>x{t.ratio:.3f}</b> of eager's, simulated x{r.lat_ratio:.3f}"
            if t is not None else f"latency x{r.lat_ratio:.3f} (simulated only)")
    slow = (" <b style='color:#c44e52'>(slow: more than x1.5 of eager's step)</b>"
            if t is not None and t.ratio > SLOW else "")
    return (f"budget x{r.budget_ratio:.2f} → peak <b>{p.peak / MiB:.2f} MiB</b> "
            f"(x{r.mem_ratio:.3f}), {time}{slow}, "
            f"{escape(p.applied)}{met}; bound to <code>{escape(s.name)}</code>")


class BudgetSlider:
    def __init__(self, session: Session, plot: bool = True):
        import ipywidgets as w
        self.session = session
        self.plot = plot
        r = session.result
        ratios = [p.peak / r.reference_peak for p in r.pareto] or [r.mem_ratio]
        lo = math.floor(min(ratios) * 100) / 100
        hi = max(1.0, math.ceil(max(ratios) * 100) / 100)
        start = r.budget_ratio if r.budget_kind == "mem" and r.budget_ratio else r.mem_ratio
        self.slider = w.FloatSlider(value=min(max(start, lo), hi), min=lo, max=hi, step=0.01,
                                    description="memory budget", continuous_update=False,
                                    readout_format=".2f", style={"description_width": "initial"},
                                    layout=w.Layout(width="520px"))
        self.status = w.HTML(value=_status(session))
        self.image = w.Image(format="png", layout=w.Layout(max_width="760px"))
        self.redraws = 0
        self._syncing = False
        self._draw()
        self.slider.observe(self._moved, names="value")
        session.listeners.append(self._reselected)
        self.box = w.VBox([self.slider, self.status] + ([self.image] if plot else []))

    def _draw(self) -> None:
        if not self.plot:
            return
        from .plots import png, timeline_figure
        fig = timeline_figure(self.session.result, before=False)
        self.image.value = png(fig)
        fig.clear()
        self.redraws += 1

    def _moved(self, change) -> None:
        if self._syncing:
            return
        try:
            self.session.reselect(mem_budget=float(change["new"]))   # calls _reselected
        except Exception as e:  # shown in the widget: an observer's exception is lost
            self.status.value = f"<b style='color:#c44e52'>error:</b> {escape(str(e))}"

    def _reselected(self, plan) -> None:
        """After any re-selection (this slider or %magis_budget): show the bound plan."""
        r = self.session.result
        if r.budget_kind == "mem" and r.budget_ratio is not None:
            self._syncing = True    # move the knob without selecting again
            try:
                self.slider.value = min(max(r.budget_ratio, self.slider.min), self.slider.max)
            finally:
                self._syncing = False
        self.status.value = _status(self.session)
        self._draw()

    def _ipython_display_(self):
        from IPython.display import display
        display(self.box)
