"""A failed capture says what to do, and doing it works (issue 55, item 4).

Wav2Vec2ForCTC, tiny: its own CTC loss has value-dependent shapes
(``labels.masked_select``), which the message traces to transformers' loss and
answers with a loss_fn that then captures and trains as eager; its SpecAugment
draws masks with numpy, which a capture would have frozen into the plan (Note
[a draw the trace cannot see]): refused, naming the line and the config switch.
"""
import os
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.capture import CaptureError, capture
from magis_nb.program import trace
from magis_nb.verify import Reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def _wav2vec2(**overrides):
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               conv_dim=(16, 16), conv_kernel=(5, 3), conv_stride=(4, 2), vocab_size=16,
               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
               layerdrop=0.0, mask_time_prob=0.0)
    cfg.update(overrides)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**cfg)).train()


def _batch(short=5):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(1, 16, (2, 8), generator=g)
    labels[1, short:] = -100                            # padding, as HF collators pad
    return {"input_values": torch.randn(2, 1600, generator=g), "labels": labels}


def ctc(out, labels):
    """The loss_fn the message shows, as it shows it."""
    logp = out.logits.log_softmax(-1).transpose(0, 1)  # (frames, batch, vocab)
    frames = torch.full((logp.shape[1],), logp.shape[0])
    return F.ctc_loss(logp, labels.clamp(min=0), frames, (labels >= 0).sum(-1),
                      blank=0, reduction="sum")


def _refused(model, inputs, **kw) -> str:
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with pytest.raises(CaptureError) as e:
        trace(model, inputs, **kw)
    for n, p in model.state_dict().items():             # a refusal leaves the model as it was
        assert torch.equal(p, before[n]), n
    return str(e.value)


def test_the_models_own_ctc_loss_is_named_and_answered_with_a_loss_fn():
    model, batch = _wav2vec2(), _batch()
    msg = _refused(model, batch)
    assert "the model's own loss makes a tensor whose shape depends on tensor values" in msg
    assert "loss_ctc.py" in msg and "ForCTCLoss" in msg and "masked_select" in msg
    assert "pass loss_fn" in msg and "F.ctc_loss(" in msg
    assert 'optimize(model, (batch["input_values"], batch["labels"]), loss_fn=ctc)' in msg
    model.eval()                                        # the example's loss is the model's own
    with torch.no_grad():
        torch.testing.assert_close(ctc(model(batch["input_values"]), batch["labels"]),
                                   model(**batch).loss)
    model.train()


def test_the_loss_fn_the_message_shows_captures_and_trains_as_eager():
    model, batch = _wav2vec2(), _batch()
    inputs = (batch["input_values"], batch["labels"])
    res = magis_nb.optimize(model, inputs, loss_fn=ctc, max_states=4, time_budget=3,
                            device_profile="cpu")
    chk = Reference(model, inputs, ctc, "train").check(res.module)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == res.plan.peak
    # labels of other lengths, same shape: the lengths are tensors of the step
    # (Note [CTC with fixed shapes]), not constants of the plan
    other = _batch(short=2)
    other = (batch["input_values"], other["labels"])
    chk = Reference(model, other, ctc, "train").check(res.module)
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak <= res.plan.peak           # log_alpha planned at its largest


@pytest.mark.parametrize("switch, now", [("mask_time_prob", 0.05), ("mask_feature_prob", 0.2)])
def test_spec_augment_is_refused_naming_its_line_and_config_switch(switch, now):
    """The time mask failed the trace in its backward with no line; the feature
    mask captured silently, frozen into the plan."""
    model = _wav2vec2(**{switch: now, "mask_feature_length": 4})
    batch = _batch()
    inputs = (batch["input_values"], batch["labels"])
    np_state, py_state = np.random.get_state()[1].copy(), random.getstate()
    msg = _refused(model, inputs, loss_fn=ctc)
    assert "draws a random number outside torch" in msg
    assert "modeling_wav2vec2.py" in msg and "np.random.rand" in msg and "numpy.random.rand" in msg
    assert f"model.config.{switch} = 0.0 (now {now})" in msg
    assert "model.config.apply_spec_augment = False (now True)" in msg
    # the trace drew from numpy's global generator: put back
    assert (np.random.get_state()[1] == np_state).all() and random.getstate() == py_state
    if switch == "mask_time_prob":                      # what it says: now it captures
        setattr(model.config, switch, 0.0)
        assert capture(model, inputs, loss_fn=ctc).constants == {}


def test_wav2vec2_layerdrop_names_its_config_entry_and_no_unrelated_line():
    """Wav2Vec2 reads config.layerdrop where it branches (Bart copies it onto the
    encoder: tests/test_random_branch.py); the line the recording pass started
    from (``labels.max()``) is not the branch's and is not named."""
    model = _wav2vec2(layerdrop=0.1)
    msg = _refused(model, _batch())
    assert "branches on a random draw" in msg and "modeling_wav2vec2.py" in msg
    assert "model.config.layerdrop = 0.0 (now 0.1)" in msg
    assert "labels.max()" not in msg


class _PythonRandom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        keep = random.random() < 0.9                     # a draw torch does not see
        return self.lin(x) * (1.0 if keep else 0.0)


def test_a_python_random_draw_is_refused_naming_the_line():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    msg = _refused(_PythonRandom(), (x, y), loss_fn=F.mse_loss)
    assert "random.random" in msg and "test_capture_messages.py" in msg
    assert "keep = random.random() < 0.9" in msg
    assert "draw with torch in fixed shapes" in msg
