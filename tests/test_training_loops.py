"""Training loops drive the optimized module as they drive eager PyTorch.

`loss = model_opt(x, y); loss.backward()` (Note [the step behind autograd],
runtime/module.py): a hand-written loop with gradient accumulation, gradient
clipping, AdamW and an LR scheduler, and a Lightning `Trainer`, each give the
eager loop's losses and weights.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb


class Block(nn.Module):
    """A small transformer-ish block: embedding, pre-LayerNorm MLP with a residual,
    LayerNorm, head (dropout 0, smooth activations: no gradient sits at exactly 0)."""

    def __init__(self, d_in=16, d=32, n_cls=5):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.ln1 = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.0)
        self.ln2 = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_cls)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.drop(self.fc2(F.gelu(self.fc1(self.ln1(h)))))
        return self.head(self.ln2(h))


def _batches(n, seed=1, b=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 16, generator=g), torch.randint(0, 5, (b,), generator=g))
            for _ in range(n)]


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


# -- a plain loop: accumulation, clipping, AdamW, a scheduler --------------------------

STEPS, MICRO, MAX_NORM = 3, 2, 0.05


def _train(loss_of, model, micro):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses, norms, lrs = [], [], []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for x, y in micro[s * MICRO:(s + 1) * MICRO]:
            loss = loss_of(x, y)
            (loss / MICRO).backward()
            losses.append(loss.detach().clone())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return torch.stack(losses), norms, lrs, opt


def test_plain_loop_with_accumulation_clipping_adamw_and_scheduler():
    torch.manual_seed(0)
    model = Block()
    eager = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    micro = _batches(STEPS * MICRO, b=32)
    # the roofline profile, not timings: the same plan on a busy machine
    res = magis_nb.optimize(model, micro[0], loss_fn=F.cross_entropy, mem_budget=0.6,
                            time_budget=10, max_states=8, device_profile="cpu")
    mod = res.module
    assert mod.model is model
    # a plan that changes the program (here the batch split into pieces): not eager's
    # own ops in another order, whose gradients would be eager's bit for bit
    assert res.plan.fission or res.plan.remat or res.plan.algebra, res.plan

    want, want_norms, want_lrs, _ = _train(lambda x, y: F.cross_entropy(eager(x), y),
                                           eager, micro)
    got, got_norms, got_lrs, opt = _train(mod, model, micro)

    _close(got, want)                                        # every micro-batch's loss
    assert got_lrs == want_lrs == [1e-2, 5e-3, 2.5e-3]       # the scheduler stepped
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms),
                               rtol=1e-4, atol=1e-6)
    assert max(got_norms) > MAX_NORM                         # clipping took effect
    for (n, p), q, p0 in zip(model.named_parameters(), eager.parameters(), start):
        _close(p.detach(), q.detach())
        assert not torch.equal(p.detach(), p0), n            # the optimizer moved it
        st = opt.state[p]
        assert int(st["step"]) == STEPS and float(st["exp_avg_sq"].abs().max()) > 0, n


# -- Lightning -------------------------------------------------------------------------

def _lightning_fit(model, model_opt, batches):
    """Fits a LightningModule for len(batches) steps; its training_step runs
    `model_opt` when given, else eager. Returns the losses training_step returned."""
    pl = pytest.importorskip("pytorch_lightning")
    from torch.utils.data import DataLoader, TensorDataset

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            if model_opt is not None:
                self.model_opt = model_opt        # a submodule: its parameters are the model's
            else:
                self.model = model
            self.losses, self.grad_modes = [], []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.grad_modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                                    self.training))
            if model_opt is not None:
                loss = self.model_opt(x, y)
            else:
                loss = F.cross_entropy(self.model(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    xs = torch.stack([x for x, _ in batches])
    ys = torch.stack([y for _, y in batches])
    b = batches[0][0].shape[0]
    loader = DataLoader(TensorDataset(xs.flatten(0, 1), ys.flatten(0, 1)), batch_size=b,
                        shuffle=False)
    lit = Lit()
    trainer = pl.Trainer(max_steps=len(batches), accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings():
        # harmless: the advice to load the 3 batches with more workers (machines with
        # more than 2 cores)
        warnings.filterwarnings("ignore", message=".*num_workers.*")
        trainer.fit(lit, loader)
    assert trainer.global_step == len(batches)
    assert all(m == (True, False, True) for m in lit.grad_modes), lit.grad_modes
    return torch.stack(lit.losses)


def test_lightning_trainer_trains_the_optimized_module_like_eager():
    pytest.importorskip("pytorch_lightning")
    from magis_nb.program import trace

    torch.manual_seed(0)
    model = Block()
    eager = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    batches = _batches(3, seed=2)
    model_opt = trace(model, batches[0], loss_fn=F.cross_entropy).module()
    assert {id(p) for p in model_opt.parameters()} == {id(p) for p in model.parameters()}

    want = _lightning_fit(eager, None, batches)
    got = _lightning_fit(model, model_opt, batches)

    assert len(got) == len(want) == 3
    _close(got, want)
    for (n, p), q, p0 in zip(model.named_parameters(), eager.parameters(), start):
        _close(p.detach(), q.detach())
        assert not torch.equal(p.detach(), p0), n
