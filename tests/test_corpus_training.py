"""Training code as people write it (bench/corpus_training): steps that draw at
random (a DDPM's timesteps and noise, a VAE's reparameterised draw, dropout)
train as eager does over a 5-step loop with a new seed per step, and a branch on
a random draw (layerdrop) is refused at capture instead of raising at step k."""
import copy

import pytest
import torch

import magis_nb
from magis_nb.bench import corpus_models as cm
from magis_nb.capture import CaptureError
from magis_nb.capture.export import call_step

pytest.importorskip("transformers")

STEPS = 5


@pytest.mark.parametrize("name", ["ddpm-unet", "vae", "nanogpt"])
def test_random_steps_train_as_eager_over_a_loop(name, one_thread):
    case = cm.build(name)
    eager = copy.deepcopy(case.model)
    res = magis_nb.optimize(case.model, case.inputs, loss_fn=case.loss_fn, mem_budget=0.7,
                            time_budget=5, max_states=8, device_profile="cpu")
    assert res.plan.applied != "re-order only" or res.met, res.plan.applied
    mod = res.module
    # SGD, not Adam: a gradient zero in exact arithmetic (attention's key bias) is
    # rounding noise on both sides, which Adam scales up to a full step of either sign
    opt = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    opt_e = torch.optim.SGD(eager.parameters(), lr=1e-3)
    for k in range(STEPS):                       # a new draw every step, the same on both sides
        torch.manual_seed(100 + k)
        opt.zero_grad(set_to_none=True)
        loss = mod(*case.inputs)
        loss.backward()
        opt.step()
        torch.manual_seed(100 + k)
        opt_e.zero_grad(set_to_none=True)
        want = call_step(eager, case.inputs, case.loss_fn)
        want.backward()
        opt_e.step()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: step {k}: {m}")
    for (n, p), q in zip(case.model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")


def test_layerdrop_is_refused_at_capture_with_its_switch():
    case = cm.build("bart-layerdrop")
    before = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    with pytest.raises(CaptureError) as e:
        magis_nb.optimize(case.model, case.inputs, mem_budget=0.5, time_budget=5, max_states=4)
    msg = str(e.value)
    assert "branches on a random draw" in msg
    assert "layerdrop = 0.0 (now 0.2)" in msg
    for n, p in case.model.named_parameters():         # the user's model is left as it was
        assert torch.equal(p, before[n]), n
