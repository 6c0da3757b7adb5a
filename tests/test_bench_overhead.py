"""bench overhead: the generated program against eager, with the ops that differ most."""
import pytest

from magis_nb.bench.overhead import main, run


@pytest.mark.slow
def test_overhead_reports_the_ratio_and_the_ops_that_differ_most(capsys):
    r = run("mlp", "tiny", reps=3, compiled=False, top=5)
    assert 0 < r["time_ratio_q1"] <= r["time_ratio"] <= r["time_ratio_q3"]
    assert r["program_s"] > 0 and r["pytorch_s"] > 0 and "program_kernels_ms" not in r
    assert 0 < len(r["ops"]) <= 5
    diffs = [abs(o["program_ms"] - o["pytorch_ms"]) for o in r["ops"]]
    # listed by decreasing difference (each printed rounded to 0.01 ms)
    assert all(a >= b - 0.02 for a, b in zip(diffs, diffs[1:])), diffs
    assert main(["--models", "mlp", "--reps", "2", "--top", "3"]) == 0
    assert "mlp (tiny): program / PyTorch x" in capsys.readouterr().out
