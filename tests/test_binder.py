"""Binder's environment, rebuilt without docker: a fresh venv from binder/requirements.txt
runs every tutorial notebook.

The PyTorch CPU index line is left out (this network reaches PyPI only); pip then takes
torch==2.13.0 from the same pin. Everything else is installed exactly as listed,
from the repository root as repo2docker does.
"""
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def test_binder_files():
    req = [line.strip() for line in (BINDER / "requirements.txt").read_text().splitlines()]
    assert INDEX in req and "torch==2.13.0" in req and "." in req
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"


@pytest.mark.slow
def test_fresh_binder_env_runs_every_notebook(tmp_path):
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    req = tmp_path / "requirements.txt"
    req.write_text("\n".join(x for x in lines if not x.startswith("--extra-index-url")) + "\n")
    env_dir = tmp_path / "binder-venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(req)], cwd=ROOT,
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-4000:]
    # the package came from the requirements, not from this checkout's venv
    where = subprocess.run([str(py), "-c", "import magis_nb, torch; print(magis_nb.__file__, "
                            "torch.__version__)"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert str(env_dir) in where.stdout and "2.13.0" in where.stdout
    notebooks = sorted(str(p) for p in (ROOT / "notebooks").glob("[0-9]*.ipynb"))
    assert notebooks
    run = subprocess.run([str(py), "-m", "magis_nb.notebook.run", *notebooks,
                          "--out", str(tmp_path / "executed")],
                         cwd=tmp_path, capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert run.stdout.count(" s ok") == len(notebooks)
