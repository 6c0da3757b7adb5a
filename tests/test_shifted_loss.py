"""Note [the shifted loss] (ir/shifted_loss.py): the next-token loss over every
position with the last one ignored, so the LM head runs along the sequence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_sequence_fission import exact

from magis_nb import zoo
from magis_nb.analysis import DGraph, apply_fission, build_ftree
from magis_nb.analysis.ftrans import FTrans
from magis_nb.program import trace
from magis_nb.verify import Reference
from magis_nb.zoo.gpt import CausalLM

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _targets(g):
    return [n.target for n in g.ops]


def _gpt(batch=2, seq=32):
    torch.manual_seed(0)
    c = dict(batch=batch, seq=seq, vocab=96, d=32, heads=2, layers=1, ffn=64, max_pos=seq,
             pos="learned", mlp="gelu", window=None, qkv_bias=False)
    ids = torch.randint(0, 96, (batch, seq))
    labels = ids.clone()
    labels[0, 7] = -100            # an ignored target inside the sequence too
    return CausalLM(c, p=0.0), (ids, labels)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_head_runs_over_every_position_and_equals_eager(name):
    if name == "gpt":
        m, inputs = _gpt()
    else:
        case = zoo.build(name)
        m, inputs = case.model, case.inputs
    prog = trace(m, inputs)
    g = prog.graph
    t = _targets(g)
    assert "aten.slice_backward.default" not in t
    B, S = inputs[0].shape
    lsm = [n for n in g.ops if n.target == "aten._log_softmax.default"]
    assert [n.outputs[0].shape[0] for n in lsm] == [B * S]
    chk = Reference(m, inputs, None, "train", 0).check(prog.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    assert chk.measured_peak == prog.simulate().peak


def test_the_head_splits_along_the_sequence():
    """The LM head's forward and backward (logits, log-softmax, NLL and their
    gradients) sit in one region of the sequence component, split exactly."""
    m, inputs = _gpt(seq=64)
    prog = trace(m, inputs)
    g = prog.graph
    dg = DGraph(g)
    comp = next(c for c in dg.components if ("x0", 1) in c.inputs)
    head = {n.id for n in g.ops if n.target in ("aten._log_softmax.default",
                                                 "aten._log_softmax_backward_data.default")}
    assert head <= set(comp.ops)
    ref = Reference(m, inputs, None, "train", 0)
    runs = 0
    for c in build_ftree(dg, prog.hotspots()):
        if c.comp == comp.id and head <= c.ops:
            split = prog.with_graph(apply_fission(dg, [FTrans(c.ops, c.comp, 4)]))
            exact(split, ref)
            runs += 1
    assert runs >= 1


class TwiceRead(nn.Module):
    """The shifted logits read by the loss and by something else: left alone."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))[:, :-1]
        ce = F.cross_entropy(logits.reshape(-1, 50), labels[:, 1:].reshape(-1))
        return ce + 1e-3 * logits.float().pow(2).mean()


def test_other_readers_of_the_shifted_logits_keep_the_graph():
    torch.manual_seed(0)
    m, ids = TwiceRead(), torch.randint(0, 50, (2, 12))
    prog = trace(m, (ids, ids.clone()))
    assert "aten.slice_backward.default" in _targets(prog.graph)
    chk = Reference(m, (ids, ids.clone()), None, "train", 0).check(prog.module())
    assert chk.comparison.allclose
