"""Capture takes what users write: dict batches, keyword and non-tensor arguments,
lifted tensor constants, a tied name the forward never reads, value-dependent
branches specialized on the example (and re-checked when the program runs)."""
import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.capture.specialize import SpecializationError
from magis_nb.program import trace
from magis_nb.verify import check_step


@dataclass
class LMOut:                      # a ModelOutput-like dataclass
    loss: torch.Tensor | None
    logits: torch.Tensor


class HFStyle(nn.Module):
    """Called as ``model(input_ids=..., attention_mask=..., labels=..., flag)``;
    builds a tensor constant in forward; a second name of its head's bias that
    forward never reads (as HF BERT's ``cls.predictions.bias``)."""

    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)
        self.head.weight = self.emb.weight
        self.bias = self.head.bias            # tied, never read under this name

    def forward(self, input_ids, attention_mask=None, labels=None, scale_by=None,
                return_hidden=False):
        h = torch.tanh(self.mix(self.emb(input_ids)))
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        h = h * torch.tensor(0.5)               # lifted: _tensor_constant0
        if scale_by is not None:
            h = h * scale_by
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return LMOut(loss, logits) if not return_hidden else (loss, h)


def _batch(b=4, s=6, vocab=40):
    ids = torch.randint(0, vocab, (b, s))
    return {"input_ids": ids, "attention_mask": torch.ones(b, s), "labels": ids.clone(),
            "scale_by": 2.0}


def test_dict_batch_constants_and_tied_unused_name_are_exact():
    torch.manual_seed(0)
    m, batch = HFStyle(), _batch()
    prog = trace(m, batch)
    cap = prog.captured
    assert list(cap.constants) == ["_tensor_constant0"]
    assert cap.tied == {"head.weight": "emb.weight", "head.bias": "bias"}
    assert [r[1] for r in cap.output_roles if r[0] == "grad"].count("emb.weight") == 1
    chk = check_step(m, batch, None, "train", lambda mm: prog.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == prog.simulate().peak


def test_optimize_dict_batch_plans_are_allclose_and_checked_calls():
    torch.manual_seed(0)
    m, batch = HFStyle(d=32), _batch(b=8, s=16)
    res = magis_nb.optimize(m, batch, mem_budget=0.6, time_budget=5, max_states=40)
    for plan in res.pareto[:3]:
        chk = check_step(m, batch, None, "train", lambda mm: res.module_for(plan))
        assert chk.comparison.allclose, chk.comparison.mismatches
    mod = res.module
    # called as the model is called
    loss = mod(**batch)
    assert loss.dim() == 0
    with pytest.raises(ValueError, match="scale_by.*2.0"):
        mod(**{**batch, "scale_by": 3.0})
    with pytest.raises(TypeError, match="planned for a call like"):
        mod(batch["input_ids"], labels=batch["labels"])
    bad = {**batch, "input_ids": batch["input_ids"][:, :5]}
    with pytest.raises(ValueError, match="input_ids has shape"):
        mod(**bad)


def test_positional_non_tensor_flag():
    torch.manual_seed(0)
    m = HFStyle()
    ids = torch.randint(0, 40, (2, 5))
    inputs = (ids, None, ids, None, True)        # return_hidden=True: (loss, h)
    prog = trace(m, inputs)
    chk = check_step(m, inputs, None, "train", lambda mm: prog.module())
    assert chk.comparison.allclose, chk.comparison.mismatches


class Branchy(nn.Module):
    """Branches on a value (as HF's mask helpers do with ``padding_mask.all()``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, mask):
        if mask.all():                    # data-dependent
            return self.a(x).pow(2).mean()
        return (self.b(x) * mask[:, None]).pow(2).mean()


def test_value_branch_is_specialized_and_guarded():
    torch.manual_seed(0)
    m = Branchy()
    before = copy.deepcopy(m.state_dict())
    x, ones = torch.randn(3, 4), torch.ones(3)
    prog = trace(m, (x, ones))
    assert [v for v, _ in prog.captured.specialized] == [True]
    assert "mask.all()" in prog.captured.specialized[0][1]
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    chk = check_step(m, (x, ones), None, "train", lambda mm: prog.module())
    assert chk.comparison.allclose
    assert "expect_scalar" in prog.module().code
    with pytest.raises(SpecializationError, match="mask.all"):
        prog.module()(x, torch.tensor([1.0, 0.0, 1.0]))
