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


def test_clock_ops_times_every_aten_call_by_op_and_shapes():
    import torch

    from magis_nb.bench.overhead import clock_ops

    a, b = torch.randn(64, 32), torch.randn(32, 16)

    def step():
        (a @ b).relu().sum()

    ops = clock_ops(step, steps=3)
    mm = ops[("aten.mm.default", "[[64, 32], [32, 16]]")]
    assert mm[0] > 0 and mm[1] == 1                      # ms per step, calls per step
    assert ops[("aten.relu.default", "[[64, 16]]")][1] == 1
    assert ("aten.sum.default", "[[64, 16]]") in ops


def test_by_op_table_and_its_refusal_with_compiled(capsys):
    r = run("mlp", "tiny", reps=2, compiled=False, top=4, by_op=True)
    assert r["op_times"] == "wall clock per ATen call" and 0 < len(r["ops"]) <= 4
    assert r["program_self_ms"] > 0 and r["pytorch_self_ms"] > 0
    with pytest.raises(ValueError, match="--by-op"):
        run("mlp", "tiny", reps=1, compiled=True, top=1, by_op=True)
    with pytest.raises(SystemExit):
        main(["--models", "mlp", "--by-op", "--compiled"])
