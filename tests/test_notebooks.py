"""Every tutorial notebook runs top to bottom with nbclient, as a user's kernel would."""
import re

import nbformat
import pytest

from magis_nb.notebook import run_quickstart
from magis_nb.notebook.run import NOTEBOOKS, cell_text, execute, notebook_paths

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
TUTORIALS = ["01_quickstart", "02_budget_slider", "03_fission_unet", "04_swap_and_gpu",
             "05_your_own_model"]
EXPECT = {
    "01_quickstart": ["losses match eager", "| after |"],
    "02_budget_slider": ["budget now: x0.55", "bound module is the plan's: True"],
    "03_fission_unet": ["chosen plan:", "Pareto plans split a region", "phases match eager",
                        "tiles match eager"],
    "04_swap_and_gpu": ["optimized step:", "GPU part"],
    "05_your_own_model": ["several candidate models", "loss ", "checked against eager: True"],
}


def test_all_tutorials_present():
    assert [p.stem for p in notebook_paths()] == TUTORIALS


def check(nb, stem):
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    views = [o["data"][WIDGET_VIEW]["model_id"] for o in outs if WIDGET_VIEW in o.get("data", {})]
    pngs = [o for o in outs if "image/png" in o.get("data", {})]
    assert len(views) >= 2 and len(pngs) >= 2, stem      # progress + slider, 2 figures
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    assert all(v in state for v in views)                # saved: the views render offline
    # only cells tagged raises-exception may fail, and only with a UsageError (which
    # IPython shows as one stderr line, no traceback)
    for c in nb.cells:
        errs = [o for o in c.get("outputs", []) if o["output_type"] == "error"]
        stderr = "".join(o.get("text", "") for o in c.get("outputs", []) if o.get("name") == "stderr")
        if "raises-exception" in c.metadata.get("tags", []):
            assert not errs and stderr.startswith("UsageError: "), c.source
        else:
            assert not errs and "UsageError" not in stderr, c.source
    text = "\n".join(cell_text(c) for c in nb.cells if c.cell_type == "code")
    for e in EXPECT[stem]:
        assert e in text, (stem, e)


@pytest.mark.slow
@pytest.mark.parametrize("stem", TUTORIALS[1:])
def test_notebook_runs(stem, tmp_path):
    check(execute(NOTEBOOKS / f"{stem}.ipynb", tmp_path), stem)   # raises on a cell error


@pytest.mark.slow
def test_quickstart_main_job(tmp_path, capsys):
    """The README's main job: runs 01 headlessly and prints the before/after table."""
    assert run_quickstart.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| plan | peak MiB |" in out and "| before |" in out and "| after |" in out
    assert "losses match eager" in out
    # on the CPU the plan does not swap, and the saving is the process's own memory
    assert "planned for this CPU: process memory (no swaps" in out
    ratio = float(re.search(r"measured process memory of one step: .* \(x([0-9.]+)\)", out)[1])
    assert ratio <= 0.6, out
    check(nbformat.read(tmp_path / "01_quickstart.ipynb", as_version=4), "01_quickstart")
