"""Graph rewrites keep eager semantics bit for bit (see Note [dropout as a mask ...])."""
import torch
import torch.nn as nn

from magis_nb.program import trace
from magis_nb.verify import check_step


class Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)
        self.d = nn.Dropout(0.37)

    def forward(self, x):
        return self.d(self.l(x).t()).pow(2).mean()   # dropout of a non-contiguous tensor


def test_dropout_is_decomposed_and_bit_exact():
    m = Drop()
    x = torch.randn(128, 64)
    prog = trace(m, (x,))
    targets = [n.target for n in prog.graph.ops]
    assert "aten.native_dropout.default" not in targets
    assert targets.count("aten.bernoulli_.float") == 1
    chk = check_step(m, (x,), None, "train", lambda _: prog.module(), seed=11, rtol=0, atol=0, rel_atol=0)
    assert chk.comparison.allclose, chk.comparison.mismatches


def test_eval_dropout_is_left_alone():
    m = Drop().eval()
    prog = trace(m, (torch.randn(128, 64),), mode="infer")
    assert "aten.bernoulli_.float" not in [n.target for n in prog.graph.ops]


class Upsample(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = nn.functional.interpolate(self.c(x), scale_factor=2, mode="nearest")
        return y.to(torch.float64).pow(2).mean()


def test_metadata_asserts_are_dropped_and_the_step_is_unchanged():
    """See Note [metadata asserts]: the raw capture has them, the traced graph not."""
    from magis_nb.capture import capture
    from magis_nb.ir.build import build_graph
    m, x = Upsample(), torch.randn(4, 3, 8, 8)
    assert_op = "aten._assert_tensor_metadata.default"
    raw = [n.target for n in build_graph(capture(m, (x,), mode="train")).ops]
    assert assert_op in raw
    prog = trace(m, (x,))
    assert assert_op not in [n.target for n in prog.graph.ops]
    assert len(prog.graph.ops) == len(raw) - raw.count(assert_op)
    chk = check_step(m, (x,), None, "train", lambda _: prog.module(), rtol=0, atol=0, rel_atol=0)
    assert chk.comparison.allclose, chk.comparison.mismatches


def test_low_precision_dropout_mask_is_drawn_apart_from_its_input_and_packs():
    """A bf16 dropout's mask is a bool drawn into a tensor made from its input's
    shape and strides, not from the input (as the fp32 mask is): otherwise every
    region holding the input's producer and the dropout leaves and re-enters
    itself, and a bf16 GPT has no whole-step batch split. Its largest F-Tree
    candidate covers the step as the fp32 model's does, with a twin that packs
    the masks 8 to a byte (Note [packed masks])."""
    from magis_nb import zoo
    from magis_nb.search.space import Space
    from magis_nb.simulate.cost import make_cost

    def largest(dtype):
        case = zoo.build("gpt", "tiny")
        model = case.model.to(dtype)
        prog = trace(model, case.inputs, loss_fn=case.loss_fn)
        ops = prog.graph.ops
        if dtype == torch.bfloat16:
            masks = [n for n in ops if n.name.endswith("_mask")]
            assert masks and all(n.target == "aten.empty_strided.default"
                                 and n.kwargs["dtype"] == torch.bool for n in masks)
        space = Space(prog, make_cost("rtx3090"), async_copies=True)
        big = max(space.cands, key=lambda c: len(c.ops))
        assert big.twin is not None and space.cands[big.twin].pack != big.pack
        return len(big.ops) / len(ops)

    fp32, bf16 = largest(torch.float32), largest(torch.bfloat16)
    assert fp32 > 0.7 and bf16 > 0.9 * fp32


class ZeroDropAttention(nn.Module):
    """Two attention layers with their probabilities through a p=0 dropout (as
    in many Hugging Face configs): eager returns the probabilities themselves,
    the capture a clone, which the first layer saved for its backward next to
    the softmax's output while the second's backward ran."""

    def __init__(self, keep_layout_copy: bool = False):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(32, 96) for _ in range(2))
        self.drop = nn.Dropout(0.0)
        self.keep = keep_layout_copy

    def forward(self, x):
        for lin in self.qkv:
            q, k, v = lin(x).chunk(3, -1)
            x = x + self.drop((q @ k.transpose(-1, -2)).softmax(-1)) @ v
        if self.keep:      # a copy that changes the layout stays a copy
            x = x.transpose(0, 1).contiguous()
        return x.pow(2).mean()


def test_a_clone_that_copies_nothing_is_read_through_and_the_peak_is_eagers():
    from magis_nb.verify import Reference

    torch.manual_seed(0)
    m = ZeroDropAttention()
    x = torch.randn(4, 256, 32)
    prog = trace(m, (x,))
    assert "aten.clone.default" not in [n.target for n in prog.graph.ops]
    ref = Reference(m, (x,), None, "train")
    chk = ref.check(prog.module())
    assert chk.comparison.allclose, chk.comparison.mismatches
    # each layer's probabilities (1 MiB) are saved once, as in eager
    assert chk.measured_peak == prog.simulate().peak
    assert abs(chk.measured_peak - ref.eager_peak) < 2**20 // 8

    kept = trace(ZeroDropAttention(keep_layout_copy=True), (x,))
    assert "aten.clone.default" in [n.target for n in kept.graph.ops]


def test_node_refs_follow_reassigned_args():
    # Node.refs() is kept; a pass that rewrites a node assigns new args or kwargs
    from magis_nb.ir.graph import iter_refs, map_refs
    prog = trace(Drop(), (torch.randn(8, 64),))
    n = next(n for n in prog.graph.ops if len(set(n.refs())) >= 2)
    old = list(n.refs())
    assert old == iter_refs((n.args, n.kwargs)) and n.refs() is n.refs()
    n.args = map_refs(n.args, lambda r, k: old[-1] if k == 0 else r)
    assert n.refs() == iter_refs((n.args, n.kwargs)) and n.refs()[0] == old[-1] != old[0]
    n.kwargs = dict(n.kwargs, extra=old[0])
    assert n.refs()[-1] == old[0]
