"""The corpus benchmark (`python -m magis_nb.bench corpus`) and its models.

(a) every registry entry builds from its config (nothing downloaded) and runs one
eager training step the way users call it; the full sweep is slow, a subset that
covers every family is not. (b) the bench in --fast mode on models that capture
and optimize today: captured, every checked plan allclose to eager, measured
peak within 3% of the simulated one; (c, slow) the whole corpus in --fast mode
holds the acceptance bounds: at least 95% of the rows capture, every captured row
is allclose with measured peak within 3% of simulated, and no row's error is a
raw Python exception.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from magis_nb.bench import corpus, corpus_models as cm  # switches the Hub off first

transformers = pytest.importorskip("transformers")

# one or two per family: rotary + GQA + RMSNorm, learned positions, an encoder,
# an encoder-decoder, windowed vision attention, a CNN with BatchNorm, torch.nn
QUICK = ["llama", "gpt2", "bert", "t5", "swin", "resnet", "torch-transformer", "torch-lstm"]
# the bench's own smoke test: a dict-batch HF LM, torch.nn models, a checkpointed one
BENCH_MODELS = ["gpt2", "torch-transformer", "torch-lstm", "torch-checkpoint"]


def test_registry():
    assert len(cm.MODELS) >= 32
    assert set(cm.TRAINING) <= set(cm.MODELS)
    fams = {f for f, _ in cm.MODELS.values()}
    assert fams == set(cm.FAMILIES)
    for fam in cm.FAMILIES:
        assert cm.names(fam), fam
    assert set(QUICK) <= set(cm.MODELS) and set(BENCH_MODELS) <= set(cm.MODELS)
    with pytest.raises(KeyError, match="unknown corpus model"):
        cm.build("no-such-model")


def _step(name: str):
    before = torch.random.get_rng_state()
    case = cm.build(name)
    assert torch.equal(torch.random.get_rng_state(), before), "build must not disturb the caller's RNG"
    assert case.name == name and case.family == cm.MODELS[name][0]
    assert case.model.training
    if case.kind == "dict":
        assert isinstance(case.inputs, dict) and case.loss_fn is None
        assert all(isinstance(v, (torch.Tensor, bool)) for v in case.inputs.values())
        assert "labels" in case.inputs or case.inputs.get("return_loss") is True
    elif case.kind == "call":
        assert isinstance(case.inputs, tuple) and case.loss_fn is None
    else:
        assert case.kind == "tuple" and isinstance(case.inputs, tuple) and callable(case.loss_fn)
    loss = cm.eager_loss(case)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    grads = [p.grad for p in case.model.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    return case


@pytest.mark.parametrize("name", QUICK)
def test_quick_models_step(name):
    _step(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in cm.MODELS if n not in QUICK])
def test_every_model_steps(name):
    _step(name)


def test_build_is_deterministic():
    a, b = cm.build("gpt2", seed=3), cm.build("gpt2", seed=3)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    for k in a.inputs:
        assert torch.equal(a.inputs[k], b.inputs[k]), k


def test_user_error_and_summary():
    from magis_nb.capture import CaptureError

    assert corpus.user_error(CaptureError("no")) == "CaptureError: no"
    assert corpus.user_error(KeyError("_tensor_constant0")) == "'_tensor_constant0'"
    assert corpus.user_error(RuntimeError("boom")) == "boom"
    rows = [{"model": "llama", "family": "decoder", "budget": "mem:0.5", "captured": True,
             "allclose": True, "mem_ratio": 0.4, "error": None},
            {"model": "bert", "family": "encoder", "budget": "mem:0.5", "captured": False,
             "allclose": None, "mem_ratio": None, "error": "CaptureError: x"},
            {"model": "resnet", "family": "cnn", "budget": "mem:0.5", "captured": True,
             "allclose": False, "mem_ratio": 0.3, "error": None}]
    s = corpus.summary(rows)
    assert s["rows"] == 3 and s["captured"] == 2 and s["allclose"] == 1 and s["errors"] == 1
    assert s["lm_rows"] == 2 and s["lm_mem_ratio_le_0.5"] == 1


@pytest.mark.slow
def test_bench_fast(tmp_path, capsys):
    out = tmp_path / "corpus.json"
    rc = corpus.main(["--fast", "--models", ",".join(BENCH_MODELS), "--threads", "1",
                      "--timeout", "240", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "rows" in printed and "captured" in printed
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == BENCH_MODELS
    for r in rows:
        for key in ("model", "family", "captured", "plans_checked", "allclose", "sim_peak",
                    "measured_peak", "mem_ratio", "lat_ratio", "error", "seconds", "memory"):
            assert key in r, (r["model"], key)
        # planned for this CPU: no swaps, so the ratio is the process's memory
        assert r["memory"] == "process" and r["host_bytes"] == 0, r
        assert r["error"] is None, (r["model"], r["error"])
        assert r["captured"] is True and r["plans_checked"] >= 1
        assert r["allclose"] is True, (r["model"], r["checks"])
        assert abs(r["measured_peak"] - r["sim_peak"]) / r["sim_peak"] <= 0.03, r
        assert 0 < r["mem_ratio"] and 0 < r["lat_ratio"]


@pytest.mark.slow
def test_whole_corpus_fast(tmp_path):
    out = tmp_path / "corpus.json"
    assert corpus.main(["--fast", "--threads", "1", "--timeout", "400", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len({r["model"] for r in rows}) >= 30
    captured = [r for r in rows if r["captured"]]
    assert len(captured) >= 0.95 * len(rows), [(r["model"], r["error"]) for r in rows
                                                if not r["captured"]]
    for r in captured:
        assert r["allclose"] is True, (r["model"], r["checks"])
        assert abs(r["measured_peak"] - r["sim_peak"]) <= 0.03 * r["sim_peak"], r["model"]
    for r in rows:     # a failure the user sees is one of magis_nb's errors, with a hint
        assert r["error"] is None or r["error_type"] in (
            "CaptureError", "PlanError", "SpecializationError"), (r["model"], r["error"])
