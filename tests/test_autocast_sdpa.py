"""SDPA with dropout under CPU bf16 autocast (Note [the joint replayed under
autocast] in magis_nb/capture/upstream.py): the capture records eager's
dtypes, fp32 attention scores included."""
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")     # configs only, no weights

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import magis_nb  # noqa: E402
from magis_nb.program import trace  # noqa: E402


class Attention(nn.Module):
    """The upstream reproducer: aot_export_module of this step under CPU bf16
    autocast raised "expected scalar type Float but found BFloat16"."""

    def __init__(self, causal=False):
        super().__init__()
        self.qkv, self.causal = nn.Linear(16, 48), causal

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if self.causal else mask,
                                           dropout_p=0.1, is_causal=self.causal)
        return o.float().square().mean()


def _grads(m, loss):
    loss.backward()
    return {"loss": loss.detach().float(), **{n: p.grad.float() for n, p in m.named_parameters()}}


def _eager(model, inputs, amp, seed=1):
    """Eager's loss and gradients; the backward under the same autocast, as
    the capture traces it (and as `verify.Reference` runs eager)."""
    m = copy.deepcopy(model)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = m(*args, **kwargs)
        return _grads(m, out if isinstance(out, torch.Tensor) else out.loss)


def _planned(model, mod, inputs, seed=1):
    m = copy.deepcopy(model)
    mod.model = m
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    torch.manual_seed(seed)
    return _grads(m, mod(*args, **kwargs))


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_dropout_captures_eager_dtypes(causal):
    """With a float mask the capture failed; with is_causal it passed but
    computed the attention scores in bf16 where eager computes them in fp32.
    Either way the program now is eager's step, bit for bit."""
    torch.manual_seed(0)
    model = Attention(causal)
    inputs = (torch.randn(2, 8, 16), torch.zeros(2, 1, 8, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prog = trace(model, inputs, mode="train")
    scores = [t.dtype for n in prog.graph.ops if n.name.startswith("bmm")
              for t in n.outputs if t is not None]
    assert torch.float32 in scores and torch.bfloat16 in scores     # fp32 fwd, bf16 bwd
    want = _eager(model, inputs, amp=True)
    got = _planned(model, prog.module(), inputs)
    assert _diff(got, want) == 0.0
    # the same seed draws the same masks: another one moves the loss far more
    spread = _diff(want, _eager(model, inputs, amp=False))
    assert _diff(_eager(model, inputs, amp=True, seed=2), want) > 10 * spread


def test_gpt2_default_config_under_bf16_autocast_optimizes(one_thread):
    """GPT-2 as transformers builds it (SDPA, dropout 0.1) with a padding mask:
    every plan on the front is within twice eager's own fp32-vs-bf16 spread."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    model = GPT2LMHeadModel(cfg).train()
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 128, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, 24:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    want = _eager(model, batch, amp=True)
    spread = _diff(want, _eager(model, batch, amp=False))
    assert spread > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = magis_nb.optimize(model, batch, time_budget=5, max_states=10)
    assert res.verified and not res.failed
    for plan in res.pareto[:3]:
        assert _diff(_planned(model, res.module_for(plan), batch), want) <= 2 * spread, plan
