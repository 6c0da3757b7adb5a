"""bf16 autocast steps: the captured program runs eager's ops in eager's dtypes."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb
from magis_nb.program import trace


class Block(nn.Module):
    """Linear layers autocast to bf16 with dropout on their bf16 outputs, a
    LayerNorm autocast keeps in fp32."""

    def __init__(self, d=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = x + self.drop(self.down(F.gelu(self.up(self.ln(x)))))
        return self.head(self.drop(h))


def _step(model, x, y, amp, seed=1):
    m = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = F.cross_entropy(m(x), y)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()}


def _rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def test_captured_bf16_step_is_bit_identical_to_eager():
    torch.manual_seed(0)
    model, x, y = Block(), torch.randn(16, 32), torch.randint(0, 10, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prog = trace(model, (x, y), loss_fn=F.cross_entropy)
    assert any(t is not None and t.dtype == torch.bfloat16 for n in prog.graph.ops for t in n.outputs)
    want_loss, want = _step(model, x, y, amp=True)
    m = copy.deepcopy(model)
    mod = prog.module()
    mod.model = m
    torch.manual_seed(1)
    loss = mod(x, y)
    loss.backward()
    got = {n: p.grad.float() for n, p in m.named_parameters()}
    assert torch.equal(loss.float(), want_loss)
    assert _rel(got, want) == 0.0


def test_optimized_bf16_plans_within_eager_own_spread():
    torch.manual_seed(0)
    model, x, y = Block(64), torch.randn(64, 64), torch.randint(0, 10, (64,))
    _, g32 = _step(model, x, y, amp=False)
    _, g16 = _step(model, x, y, amp=True)
    spread = _rel(g16, g32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = magis_nb.optimize(model, (x, y), loss_fn=F.cross_entropy, mem_budget=0.6,
                                time_budget=5, max_states=30)
    assert res.verified and not res.failed
    for plan in res.pareto[:3]:
        m = copy.deepcopy(model)
        mod = res.module_for(plan)
        mod.model = m
        torch.manual_seed(1)
        mod(x, y).backward()
        got = {n: p.grad.float() for n, p in m.named_parameters()}
        assert _rel(got, g16) <= spread, plan


def test_bf16_gpt_split_whole_step_with_packed_masks_matches_eager(one_thread):
    """GPT under bf16 autocast (dropout on bf16 activations) split along the
    batch over the whole step, its dropout masks packed 8 to a byte (Note
    [low-precision dropout], Note [packed masks]): the gradients are within
    eager's own bf16-vs-fp32 spread of eager's autocast step (the same masks:
    other masks would be off by the gradients' size), at exactly the simulated
    peak, below the unsplit one."""
    from magis_nb import zoo
    from magis_nb.runtime import OptimizedModule
    from magis_nb.search.space import Space
    from magis_nb.simulate.cost import make_cost
    from magis_nb.verify import Reference
    case = zoo.build("gpt", "tiny")
    model = case.model
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prog = trace(model, case.inputs, loss_fn=case.loss_fn)
    assert any(n.name.endswith("_mask") and n.outputs[0].dtype == torch.bool
               for n in prog.graph.ops)
    space = Space(prog, make_cost("rtx3090"), async_copies=True)
    big = max((c for c in space.cands if c.pack), key=lambda c: len(c.ops))
    assert len(big.ops) > 0.7 * len(prog.graph.ops)
    g, kept = space.build(((big.id, 4),), ())
    st = space.evaluate(((big.id, 4),), kept, g)
    assert any(n.name.endswith("_packed") for n in g.ops)
    assert st.peak < space.evaluate((), (), prog.graph).peak

    def grads(amp, split=False):
        m = copy.deepcopy(model)
        torch.manual_seed(1)
        if split:
            OptimizedModule(m, prog.captured, g, st.order)(*case.inputs).backward()
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = m(*case.inputs).loss
            loss.backward()
        return {n: p.grad.float() for n, p in m.named_parameters()}

    want, fp32 = grads(True), grads(False)
    assert _rel(grads(True, split=True), want) <= _rel(want, fp32)
    chk = Reference(model, case.inputs, case.loss_fn, "train").check(
        OptimizedModule(model, prog.captured, g, st.order))
    assert chk.measured_peak == st.peak


def test_bf16_parameters_split_is_checked_against_eager_own_error(one_thread):
    """Note [low-precision parameters]: a GPT whose parameters are bf16, split
    along the batch, sums bf16 part gradients; its LayerNorm bias gradients
    then differ from eager's by about eager's own error against an fp32 copy
    of the step, and the fixed low-precision tolerances refused every such
    plan. The safety net allows each tensor twice eager's own error: the split
    passes, and a split that loses a part's gradient still fails."""
    from magis_nb import zoo
    from magis_nb.analysis import DGraph, apply_fission, build_ftree
    from magis_nb.search.safety import ATOL, LOW_REL_ATOL, LOW_RTOL, SafetyNet
    from magis_nb.verify import Reference
    case = zoo.build("gpt", "tiny")
    model = case.model.to(torch.bfloat16)
    prog = trace(model, case.inputs, loss_fn=case.loss_fn)
    dg = DGraph(prog.graph)
    best = max(build_ftree(dg, prog.hotspots()), key=lambda c: c.score)
    split = prog.with_graph(apply_fission(dg, [best.ftrans(4)]))
    ref = Reference(model, case.inputs, case.loss_fn, "train")
    spread = ref.spread()
    assert spread["grad blocks.0.ln1.bias"] > 0 and spread["output 0"] > 0
    plain = ref.check(split.module(), rtol=LOW_RTOL, atol=ATOL, rel_atol=LOW_REL_ATOL)
    assert not plain.comparison.allclose
    assert all("bias" in m or "weight" in m for m in plain.comparison.mismatches)
    net = SafetyNet(model, case.inputs, case.loss_fn, "train", low_precision=True)
    assert net.check(0, "x0[0]/4", split.module()) is None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    class LostPart(torch.nn.Module):    # a wrong plan: a quarter of every gradient lost
        def __init__(self, inner):
            super().__init__()
            self.inner, self.code = inner, inner.code

        def forward(self, *args):
            loss = self.inner.step(*args)
            for p in model.parameters():
                p.grad.mul_(0.75)
            return loss

    wrong = net.check(1, "wrong", LostPart(split.module()))
    assert wrong is not None and wrong.reason == "differs from eager", wrong
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
