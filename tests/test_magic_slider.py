"""The Jupyter view of %%magis (progress widget, HTML report, budget slider) in-process.

The kernel check is patched to say "Jupyter": ipywidgets then builds real widget
models (without a kernel their comms go nowhere), and the slider's observer runs
when `.value` is set from Python, as the front end would set it.
"""
import pytest
from IPython.utils.capture import capture_output

from test_magic import MODEL

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def kernel_run():
    from IPython.testing.globalipapp import get_ipython
    import magis_nb.notebook.progress as progress
    ip = get_ipython()
    ip.run_line_magic("load_ext", "magis_nb")
    real = progress.in_kernel
    progress.in_kernel = lambda shell: True
    try:
        ip.user_ns.clear()
        ip.user_ns.update({"__name__": "__main__", "__builtins__": __builtins__})
        with capture_output() as out:
            res = ip.run_cell(f"%%magis --time 4 --mem 0.6\n{MODEL}")
    finally:
        progress.in_kernel = real
    assert res.error_in_exec is None, out.stdout + out.stderr
    magics = ip.magics_manager.registry["MagisMagics"]
    return ip, out, magics


def test_jupyter_outputs(kernel_run):
    ip, out, magics = kernel_run
    kinds = [sorted(o.data) for o in out.outputs]
    widgets = [o for o in out.outputs if WIDGET in o.data]
    assert len(widgets) == 2                     # the progress line and the slider
    assert any("text/html" in k for k in kinds)  # the result's _repr_html_
    assert sum("image/png" in k for k in kinds) == 2
    assert out.stderr == ""                      # no tqdm bar in Jupyter
    html = next(o.data["text/html"] for o in out.outputs if "text/html" in o.data)
    assert "peak memory" in html and "MAGIS" in html


def test_progress_widget_reached_done(kernel_run):
    import ipywidgets as w
    ip, out, magics = kernel_run
    bar = next(m for m in w.Widget.widgets.values()
               if isinstance(m, w.FloatProgress) and m.description in ("done", "failed"))
    assert bar.description == "done" and bar.bar_style == "success" and bar.value == bar.max
    r = ip.user_ns["model_opt_result"]
    assert bar.max == 4.0 and r.states > 0


def test_slider_moves_plan_and_rebinds(kernel_run):
    ip, out, magics = kernel_run
    slider = magics.sliders["model_opt"]
    r = ip.user_ns["model_opt_result"]
    assert slider.session.result is r and slider.slider.min <= r.mem_ratio <= slider.slider.max
    first_png, first_status = bytes(slider.image.value), slider.status.value
    assert first_png.startswith(b"\x89PNG") and slider.redraws == 1
    lowest = min(r.pareto, key=lambda p: p.peak)
    target = lowest.peak / r.reference_peak + 0.005
    assert abs(target - slider.slider.value) > 0.01, "slider already at the lowest plan"
    slider.slider.value = round(target, 2)       # what dragging does in the browser
    assert r.budget_kind == "mem" and abs(r.budget_ratio - round(target, 2)) < 1e-9
    assert r.plan.peak <= r.budget and ip.user_ns["model_opt"] is r.module_for(r.plan)
    assert slider.redraws == 2 and bytes(slider.image.value) != first_png
    assert slider.status.value != first_status and f"x{round(target, 2):.2f}" in slider.status.value
    slider.slider.value = slider.slider.max      # back up: the fastest measured plan
    timed = [p for p in r.pareto if id(p) in r.times and p.peak <= r.budget]
    assert r.plan in timed and "measured" in slider.status.value
    assert r.times[id(r.plan)].ratio == min(r.times[id(p)].ratio for p in timed)
    # the simulated fastest is among those timed (the choice is among the fastest few)
    assert min(r.pareto, key=lambda p: p.latency) in timed
    assert ip.user_ns["model_opt"] is r.module_for(r.plan)


def test_magis_budget_moves_the_slider(kernel_run):
    ip, out, magics = kernel_run
    slider = magics.sliders["model_opt"]
    r = ip.user_ns["model_opt_result"]
    redraws = slider.redraws
    mid = round((slider.slider.min + slider.slider.max) / 2, 2)
    res = ip.run_cell(f"%magis_budget {mid} -q")
    assert res.error_in_exec is None
    assert abs(slider.slider.value - mid) < 1e-9 and f"x{mid:.2f}" in slider.status.value
    assert slider.redraws == redraws + 1 and abs(r.budget_ratio - mid) < 1e-9


def test_progress_widget_marks_a_failed_capture(kernel_run):
    import ipywidgets as w
    import magis_nb.notebook.progress as progress
    ip, _, _ = kernel_run
    before = set(w.Widget.widgets)
    # a shape that depends on values: no capture can trace it
    body = MODEL.replace("        h = self.emb(idx)\n",
                         "        h = self.emb(idx)\n        h = h * h[h > 0].mean()\n")
    real, progress.in_kernel = progress.in_kernel, (lambda shell: True)
    try:
        with capture_output():
            res = ip.run_cell(f"%%magis --time 2 -o broken\n{body}")
    finally:
        progress.in_kernel = real
    assert "could not capture" in str(res.error_in_exec) and "broken" not in ip.user_ns
    new = [m for k, m in w.Widget.widgets.items() if k not in before]
    bars = [m for m in new if isinstance(m, w.FloatProgress)]
    texts = [m for m in new if isinstance(m, w.HTML)]
    assert [b.description for b in bars] == ["failed"] and bars[0].bar_style == "danger"
    assert any("capture failed" in t.value for t in texts)
