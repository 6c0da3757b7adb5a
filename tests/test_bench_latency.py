"""bench latency: simulated plan latency against the measured step, one model in-process."""
import math

from magis_nb.bench.latency import main, model_rows, op_name, plans_of, summary

KEYS = {"model", "plan", "budget", "sim_ratio", "measured_ratio", "q1", "q3", "rel_error",
        "eager_ratio", "applied", "ops", "pairs", "ops_off"}


def test_one_tiny_model_rows_ratios_and_ops_off():
    keep: list = []
    rows = model_rows("zoo:mlp", time_budget=3.0, max_states=6, min_pairs=2, max_pairs=2,
                      pair_seconds=0.0, warmup=1, profile="all", profile_steps=1, top=3, keep=keep)
    res = keep[-1]
    assert len(rows) == len(plans_of(res)) >= 1
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["error"] is None, r["error"]
        assert r["pairs"] == 2
        for k in ("measured_ratio", "eager_ratio", "q1", "q3"):
            assert r[k] is not None and math.isfinite(r[k]) and r[k] > 0, (k, r[k])
        assert r["q1"] <= r["measured_ratio"] <= r["q3"]
        assert math.isclose(r["rel_error"], r["sim_ratio"] / r["measured_ratio"] - 1, abs_tol=2e-4)
    before = rows[0]
    assert before["plan"].startswith("before") and before["sim_ratio"] == 1.0
    assert before["ops"] == len(res.before.state.runs[1])
    for row, plan in keep[:-1]:
        g, order = plan.state.runs
        targets = {g.nodes[v].target for v in order}
        assert row["ops_off"], row["plan"]          # profile="all": every row
        assert 1 <= len(row["ops_off"]) <= 3
        for o in row["ops_off"]:
            assert o["target"] in targets and o["target"].startswith("aten.")
            assert o["op"] == op_name(o["target"]) and o["nodes"] >= 1
            assert o["priced_ms"] >= 0 and o["measured_ms"] >= 0 and o["repriced_ms"] >= 0
        p = row["profile"]
        assert p["step_ms"] > 0 and 0 < p["ops_ms"] <= p["step_ms"] + 1e-6
        assert p["nodes"] == len(order)
    s = summary(rows)
    assert s["plan_rows"] == len(rows) - 1 and s["within_0.25"] <= s["plan_rows"]


def test_unknown_model_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--models", "no-such-model"])
    assert "unknown models no-such-model" in capsys.readouterr().err
