"""Model zoo: determinism, a working training step, activation-dominated memory for
every tiny config, and real parameter counts for the paper configs on meta."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from magis_nb import zoo
from magis_nb.zoo.randwire import ws_dag

TINY = zoo.names("tiny")
PAPER = zoo.names("paper")


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# Published parameter counts of the real architectures (tests allow 2%).
PAPER_PARAMS = {
    "resnet": 25_557_032,  # torchvision resnet50
    "bert": 110_000_000,  # BERT-base "110M" (encoder + pooler + MLM head here)
    "vit": 86_567_656,  # ViT-B/16, 1000 classes
    "gpt": 1_315_575_808,  # EleutherAI/gpt-neo-1.3B
    "btlm": 2_600_000_000,  # cerebras/btlm-3b-8k-base "2.6B"
    "unet": 31_037_698,  # milesial Pytorch-UNet, 2 classes
    "unetpp": 9_040_000,  # Zhou et al. 2018, "9.04M" with 32 base filters
    # no published count: the two above less their BatchNorms' affine parameters
    # (2 per channel) plus a bias per conv channel (1 per channel)
    "unet-nobn": 31_031_810,
    "unetpp-nobn": 9_042_210,
    "unetpp-magis": 19_912_066,
}


def step_loss(case: zoo.ZooCase) -> torch.Tensor:
    if case.loss_fn is None:
        out = case.model(*case.inputs)
        return out["loss"] if isinstance(out, dict) else out.loss
    return case.loss_fn(case.model(*case.inputs[:-1]), case.inputs[-1])


def state(case: zoo.ZooCase) -> list[torch.Tensor]:
    return list(case.model.state_dict().values()) + list(case.inputs)


def test_names():
    assert TINY == ["mlp", "resnet", "bert", "vit", "gpt", "btlm", "llama", "unet", "unetpp",
                    "unet-nobn", "unetpp-nobn", "unetpp-magis", "densenet", "randwire"]
    assert PAPER == ["resnet", "bert", "vit", "gpt", "btlm", "unet", "unetpp", "unet-nobn", "unetpp-nobn",
                     "unetpp-magis"]
    with pytest.raises(KeyError):
        zoo.build("nope")
    with pytest.raises(ValueError):
        zoo.build("mlp", "paper")


@pytest.mark.parametrize("name", TINY)
def test_tiny_deterministic(name):
    before = torch.random.get_rng_state()
    a, b = zoo.build(name, seed=0), zoo.build(name, seed=0)
    assert torch.equal(before, torch.random.get_rng_state()), "build must not disturb the global RNG"
    assert all(torch.equal(x, y) for x, y in zip(state(a), state(b), strict=True))
    c = zoo.build(name, seed=1)
    assert not torch.equal(a.inputs[0], c.inputs[0])
    assert a.dtype == torch.float32 and a.size == "tiny" and a.description


@pytest.mark.parametrize("name", TINY)
def test_tiny_step_and_activation_share(name):
    torch.manual_seed(0)  # dropout masks
    case = zoo.build(name)
    params = list(case.model.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    saved: dict[int, int] = {}  # storage -> bytes; saved tensors stay alive, so ptrs are unique

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_loss(case)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    for pname, p in case.model.named_parameters():
        if pname.startswith("pooler."):  # bert's pooler is unused by the loss on purpose
            assert p.grad is None
            continue
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    # the paper's workloads are activation-bound; the tiny stand-ins must be too
    assert sum(saved.values()) >= 5 * param_bytes


@pytest.mark.parametrize("name", PAPER)
def test_paper_on_meta(name):
    case = zoo.build(name, "paper", device="meta")
    params = list(case.model.parameters())
    assert all(p.is_meta for p in params)
    assert all(t.is_meta for t in case.inputs)
    assert all(t.is_meta for t in case.model.buffers())
    n = sum(p.numel() for p in params)  # tied weights counted once
    assert n == pytest.approx(PAPER_PARAMS[name], rel=0.02), n
    want = torch.bfloat16 if name in ("gpt", "btlm") else torch.float32
    assert case.dtype == want and all(p.dtype == want for p in params)


def test_paper_shapes():
    gpt = zoo.build("gpt", "paper", device="meta")
    assert [t.shape for t in gpt.inputs] == [(32, 512), (32, 512)]
    assert all(t.dtype == torch.int64 for t in gpt.inputs)
    assert gpt.model.lm_head.weight is gpt.model.wte.weight
    assert zoo.build("resnet", "paper", device="meta").inputs[0].shape == (64, 3, 224, 224)
    assert zoo.build("unetpp", "paper", device="meta").inputs[1].shape == (16, 256, 256)


def test_ws_dag():
    import random

    preds = ws_dag(8, 4, 0.75, random.Random(0))
    assert preds == ws_dag(8, 4, 0.75, random.Random(0))
    assert all(u < v for v, ps in enumerate(preds) for u in ps)  # oriented low -> high: a DAG
    assert sum(map(len, preds)) == 8 * 4 // 2  # rewiring keeps the edge count
    assert preds != ws_dag(8, 4, 0.75, random.Random(1))


class _LossOnly(nn.Module):
    def __init__(self, case: zoo.ZooCase):
        super().__init__()
        self.m, self.f = case.model, case.loss_fn

    def forward(self, *a):
        if self.f is not None:
            return (self.f(self.m(*a[:-1]), a[-1]),)
        out = self.m(*a)
        return (out["loss"] if isinstance(out, dict) else out.loss,)


def test_tiny_traceable():
    # One capture (a few seconds): gpt has the most for capture to trip on: a dataclass
    # output, dropout, tied weights, masks built in forward. The capture tests cover the rest.
    from torch._functorch.aot_autograd import aot_export_module

    case = zoo.build("gpt")
    gm, sig = aot_export_module(_LossOnly(case), case.inputs, trace_joint=True, output_loss_index=0)
    # tied weights (gpt's lm_head / wte) appear under both names, each with its own
    # partial gradient: the true gradient is their sum
    trainable = {f"m.{n}" for n, p in case.model.named_parameters(remove_duplicate=False) if p.requires_grad}
    assert set(sig.backward_signature.gradients_to_parameters.values()) == trainable


@pytest.mark.parametrize("name", ["gpt", "btlm"])
def test_causal(name):
    # changing the last token must leave every earlier position's logits unchanged
    case = zoo.build(name)
    model = case.model.eval()
    ids, labels = (t[:2] for t in case.inputs)
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % model.wte.num_embeddings
    with torch.no_grad():
        a, b = model(ids, labels).logits, model(ids2, labels).logits
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])
