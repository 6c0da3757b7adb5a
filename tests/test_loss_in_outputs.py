"""A model that returns its loss inside its output: nanoGPT's ``(logits, loss)``.

`capture.outputs.locate_loss`: the loss is the one scalar of the output (the one
that requires grad where several are scalars); an ambiguous output or one with
no scalar is refused with a message naming what it holds. The report says which
element was taken, and the optimized module trains as eager does.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.capture import CaptureError
from magis_nb.program import trace


class NanoGPT(nn.Module):
    """nanoGPT's calling convention: ``logits, loss = model(idx, targets)``."""

    def __init__(self, vocab=64, d=32, T=16, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(T, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight            # tied, as nanoGPT ties them
        self.register_buffer("mask", torch.triu(torch.full((T, T), float("-inf")), 1))

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, src_mask=self.mask[:t, :t], is_causal=True)
        logits = self.head(self.ln(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def _batches(n, b=4, T=16, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (b, T), generator=g),
             torch.randint(0, vocab, (b, T), generator=g)) for _ in range(n)]


def test_nanogpt_outputs_optimize_with_no_wrapper_and_train_as_eager():
    torch.manual_seed(0)
    model = NanoGPT()
    eager = copy.deepcopy(model)
    data = _batches(3)
    res = magis_nb.optimize(model, data[0], mem_budget=0.8, time_budget=5, max_states=6,
                            device_profile="cpu")
    assert res.loss_at == "out[1]"
    assert "loss: the model's out[1]" in res.table()
    assert "out[1]" in res._repr_html_()
    mod = res.module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for idx, tgt in data:                              # 3 AdamW steps on each side
        opt.zero_grad(set_to_none=True)
        loss = mod(idx, tgt)
        loss.backward()
        opt.step()
        opt_e.zero_grad(set_to_none=True)
        _, want = eager(idx, tgt)
        want.backward()
        opt_e.step()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-4, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


class Outputs(nn.Module):
    """A linear layer whose output is shaped by ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 4)

    def forward(self, x, y):
        logits = self.lin(x)
        loss = F.cross_entropy(logits, y)
        if self.kind == "dict":
            return {"logits": logits, "total": loss}
        if self.kind == "two losses":
            return logits, loss, 0.1 * logits.pow(2).mean()
        if self.kind == "detached metric":
            return logits, loss, (logits.argmax(-1) == y).float().mean().detach()
        return (logits,)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


@pytest.mark.parametrize("kind,where", [("dict", "out['total']"), ("detached metric", "out[1]")])
def test_the_one_scalar_that_requires_grad_is_the_loss(kind, where):
    model = Outputs(kind)
    prog = trace(model, _inputs())
    assert prog.captured.loss_at == where


def test_an_ambiguous_output_is_refused_naming_the_candidates():
    with pytest.raises(CaptureError, match=r"several scalar tensors \(out\[1\], out\[2\]\).*"
                                           r"ambiguous.*loss_fn"):
        trace(Outputs("two losses"), _inputs())


def test_an_output_without_a_scalar_is_refused_naming_what_it_holds():
    with pytest.raises(CaptureError, match=r"no scalar loss in it \(out\[0\] \(6, 4\)\).*"
                                           r"\.mean\(\).*loss_fn"):
        trace(Outputs("logits only"), _inputs())
