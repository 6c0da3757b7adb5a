"""Note [a branch on a random draw] (capture/specialize.py): a forward that
branches on a value drawn at random (HF's layerdrop) is refused at capture,
naming the line and the switch, instead of a plan that raises on a later step."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from magis_nb.capture import CaptureError
from magis_nb.program import trace


class LayerDrop(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.p = p

    def forward(self, x, y):
        for layer in self.layers:
            drop = torch.rand([]).mul(2.0) < 2 * self.p      # computed from the draw
            if self.training and drop:
                continue
            x = torch.relu(layer(x))
        return F.mse_loss(x, y)


class ValueBranch(nn.Module):
    """A branch on a value of the data, not of a draw: specialized, as before."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        h = F.dropout(self.lin(x), 0.1)                       # random, but not branched on
        if x.sum() > -1e9:
            h = h * 2.0
        return F.mse_loss(h, y)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def test_a_branch_on_a_random_draw_is_refused_naming_the_line():
    with pytest.raises(CaptureError) as e:
        trace(LayerDrop(), _inputs())
    msg = str(e.value)
    assert "branches on a random draw" in msg and "aten.rand" in msg
    assert "test_random_branch.py" in msg and "drop = torch.rand([])" in msg
    assert "3 more such branch(es)" in msg and "layerdrop=0.0" in msg


def test_a_value_branch_beside_dropout_is_still_specialized():
    prog = trace(ValueBranch(), _inputs())
    assert len(prog.captured.specialized) == 1


def test_an_hf_model_with_layerdrop_names_its_config_switch():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=32, decoder_ffn_dim=32,
                                  max_position_embeddings=32, encoder_layerdrop=0.5,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  decoder_start_token_id=1)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg).train()
    ids = torch.randint(3, 64, (2, 8))
    with pytest.raises(CaptureError) as e:
        trace(model, {"input_ids": ids, "labels": ids})
    msg = str(e.value)
    assert "branches on a random draw" in msg
    assert "model.model.encoder.layerdrop = 0.0 (now 0.5)" in msg
    assert "modeling_bart.py" in msg
    model.model.encoder.layerdrop = 0.0                      # the switch: now it captures
    assert trace(model, {"input_ids": ids, "labels": ids}).captured.specialized is not None
