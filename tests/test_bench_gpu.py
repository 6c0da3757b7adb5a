"""`python -m magis_nb.bench gpu`: refuses clearly without CUDA, and its CPU dry
run goes through the whole pipeline and writes gpu.json and gpu.md."""
import json

import pytest
import torch

from magis_nb.bench import gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_without_cuda_it_says_what_to_do(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "--device cpu --size tiny" in capsys.readouterr().out
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.slow
def test_cpu_dry_run_writes_the_report(tmp_path, one_thread):
    rc = gpu.main(["--device", "cpu", "--size", "tiny", "--models", "mlp", "--simcheck", "mlp",
                   "--time-budget", "3", "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "gpu.json").read_text())
    assert "tests" not in rep and [r["model"] for r in rep["simcheck"]] == ["mlp"]
    assert rep["simcheck"][0]["rel_error"] == 0 and rep["simcheck"][0]["allclose"]
    rows = rep["compare"]
    assert [(r["strategy"], r["budget"]) for r in rows] == \
        [("eager", None), ("magis_nb", 0.5), ("magis_nb", 0.3)]
    for r in rows[1:]:
        assert r["allclose"], r["mismatches"]
        assert r["sim_rel_error"] == 0          # the CPU tracker sees what the simulator models
        # met says whether the measured peak is within the budget, both ways
        assert r["met"] == (r["peak_ratio"] <= r["budget"] * 1.001), r
    # 0.5 is met (a fission split, x0[0]/32 at 0.32 when written); 0.3 was not
    # (no swaps on the CPU), so the row above checks a met and an unmet budget
    assert rows[1]["met"]
    assert rows[2]["peak"] <= rows[1]["peak"]
    md = (tmp_path / "gpu.md").read_text()
    assert "| mlp | float32 | magis_nb | 0.3 |" in md


def test_a_failing_model_is_recorded_and_the_run_goes_on(tmp_path):
    rc = gpu.main(["--device", "cpu", "--size", "tiny", "--models", "nope", "--simcheck", "nope",
                   "--out", str(tmp_path)])
    assert rc == 1
    rep = json.loads((tmp_path / "gpu.json").read_text())
    for r in rep["simcheck"] + rep["compare"]:
        assert r["model"] == "nope" and r["error"].startswith("KeyError") and not r["allclose"]
    assert "failed: KeyError" in (tmp_path / "gpu.md").read_text()
