"""The user's own checkpointing as a start state of the search (Note [the user's
checkpoint regions] in capture/checkpoint.py, Note [the user's checkpointing as
a start state] in search/user_checkpoint.py): the capture inlines
torch.utils.checkpoint, the state recomputes what it recomputed, and is at or
below the user's eager step, simulated and measured, and equal to it."""
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from magis_nb.bench.corpus_models import CheckpointedMLP, build
from magis_nb.program import trace
from magis_nb.runtime import OptimizedModule
from magis_nb.search.algorithm import search
from magis_nb.search.objective import Objective
from magis_nb.search.proposals import proposals, split_first
from magis_nb.search.space import Space
from magis_nb.search.user_checkpoint import regions_of, user_checkpoint_state
from magis_nb.simulate.cost import make_cost
from magis_nb.verify import Reference


class ReentrantMLP(CheckpointedMLP):
    """The corpus' checkpointed MLP with reentrant checkpoints (the default of
    older transformers' gradient_checkpointing_enable)."""

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True)
        return self.head(x)


class PlainMLP(CheckpointedMLP):
    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _mlp(cls=CheckpointedMLP):
    case = build("torch-checkpoint")
    torch.manual_seed(0)
    model = cls()
    model.load_state_dict(case.model.state_dict())
    model.train()
    return model, case.inputs, case.loss_fn


def _llama(enable=True):
    case = build("llama")      # LlamaForCausalLM, 2 layers, hidden 64, random weights
    if enable:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case.model.gradient_checkpointing_enable()
    case.model.train()
    return case.model, case.inputs, None


def _space(model, inputs, loss_fn):
    prog = trace(model, inputs, loss_fn=loss_fn)
    space = Space(prog, make_cost("cpu"), async_copies=False, swap=False)
    return prog, space, split_first(space, space.evaluate((), (), prog.graph))


@pytest.mark.parametrize("make,regions,reentrant", [
    (_mlp, 4, ()),
    (_llama, 2, ()),
    (lambda: _mlp(ReentrantMLP), 4, (0, 1, 2, 3)),
], ids=["torch-checkpoint", "llama-gradient-checkpointing", "reentrant"])
def test_the_users_checkpointing_is_a_state_at_or_below_eager(make, regions, reentrant):
    model, inputs, loss_fn = make()
    prog, space, root = _space(model, inputs, loss_fn)
    cap = prog.captured
    assert len(set(cap.checkpoint.values())) == regions
    assert set(cap.checkpoint_backward.values()) == set(cap.checkpoint.values())
    assert cap.checkpoint_reentrant == reentrant
    fwd, _ = regions_of(space)
    assert fwd and all(space.base.nodes[i].category == "activation"
                       for i in (n.id for n in space.base.nodes if n.name in fwd))
    st = user_checkpoint_state(space, root)
    assert st is not None and st.batches and all(b.kind == "remat" for b in st.batches)
    ref = Reference(model, inputs, loss_fn, "train")
    # the capture inlined the checkpoints: the program as captured is far above
    # the user's step; the state is at or below it, simulated and measured
    assert root.peak > 1.5 * ref.eager_peak
    assert st.peak <= ref.eager_peak
    chk = ref.check(OptimizedModule(model, cap, *st.runs))
    assert chk.comparison.allclose, chk.comparison.mismatches[:3]
    assert chk.measured_peak <= ref.eager_peak
    assert abs(chk.measured_peak - st.peak) <= 0.03 * st.peak
    # an ordinary state: its batches rebuild it, and it has children
    g, batches = space.build(st.plan, st.batches)
    assert len(batches) == len(st.batches)
    assert space.evaluate(st.plan, batches, g).peak == st.peak
    assert proposals(space, st)


@pytest.mark.parametrize("make", [lambda: _mlp(PlainMLP), lambda: _llama(False)],
                         ids=["mlp", "llama"])
def test_a_model_without_checkpoints_has_no_such_state(make):
    prog, space, root = _space(*make())
    assert prog.captured.checkpoint == {} and prog.captured.checkpoint_reentrant == ()
    assert user_checkpoint_state(space, root) is None


def test_the_search_starts_from_it_too():
    """`search(..., starts=[st])`: the state is counted, on the front, and
    expanded like the root; its children are ordinary states (without fission,
    so that the root's F-Tree line search does not take the few states)."""
    model, inputs, loss_fn = _mlp()
    prog = trace(model, inputs, loss_fn=loss_fn)
    space = Space(prog, make_cost("cpu"), async_copies=False, swap=False, fission=False)
    root = split_first(space, space.evaluate((), (), prog.graph))
    st = user_checkpoint_state(space, root)
    log = search(space, root, Objective("lat", 1.5 * root.latency), time_budget=30,
                 max_states=20, starts=[st])
    assert "pending" in st.meta          # expanded
    assert log.best.peak <= st.peak
    assert any(s is not st and s.batches[:len(st.batches)] == st.batches for s in log.pareto)


def test_optimize_starts_from_the_users_checkpointing_and_never_returns_above_it():
    """Wired into `optimize`: the re-derived checkpointing is a start of the
    search, so with two states (the captured program and that start) the plan
    returned is it, at or below eager's step."""
    import magis_nb

    case = build("torch-checkpoint")
    res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, time_budget=20,
                            max_states=2, measure_time=False, mem_budget=1.0)
    assert res.eager_peak < res.before.peak            # capture inlined the checkpoints
    assert res.plan.state.meta.get("rule") == "user-checkpoint", res.plan.applied
    assert res.measured.peak <= res.eager_peak and res.met
