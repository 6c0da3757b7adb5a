"""Data parallel on two gloo ranks: a process-group plan and a DDP-wrapped plain plan
train like eager PyTorch on the full batch (weights after 3 SGD steps)."""
from __future__ import annotations

import copy
import traceback
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn

WORLD = 2
STEPS = 3


def _model_and_data():
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    x = torch.randn(16, 32, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)
    return m, x, y


def _sgd_steps(step, params):
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        step().backward()
        opt.step()


def _close(a: nn.Module, b: nn.Module) -> float:
    """Largest difference of the two models' parameters (inf if one is not allclose)."""
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if not torch.allclose(p, q, rtol=1e-4, atol=1e-5):
            return float("inf")
        worst = max(worst, float((p - q).abs().max()))
    return worst


def _check(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import magis_nb

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    model, x, y = _model_and_data()
    init = copy.deepcopy(model)
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]

    eager = copy.deepcopy(init)                     # one process, the full batch
    _sgd_steps(lambda: F.cross_entropy(eager(x), y), eager.parameters())

    # the plan with its gradient buckets (a small cap: several buckets)
    m = copy.deepcopy(init)
    res = magis_nb.optimize(m, (xs, ys), loss_fn=F.cross_entropy, mem_budget=0.7,
                            time_budget=5, max_states=6, process_group=True,
                            bucket_cap_mb=0.01)
    mod = res.module
    mod.comm.record = True
    _sgd_steps(lambda: mod(xs, ys), m.parameters())
    recs = [(r.bucket, r.nbytes, r.issued, r.wait_start, r.wait_end) for r in mod.comm.records]

    # a plain plan (no process group) inside DDP
    w = copy.deepcopy(init)
    plain = magis_nb.optimize(w, (xs, ys), loss_fn=F.cross_entropy, mem_budget=0.7,
                              time_budget=5, max_states=6)
    ddp = DDP(plain.module)
    _sgd_steps(lambda: ddp(xs, ys), ddp.parameters())

    out = {"code": mod.code, "records": recs, "diff": _close(m, eager),
           "wrapped_diff": _close(w, eager), "plain_code": plain.module.code}
    dist.barrier()
    dist.destroy_process_group()
    return out


def _worker(rank, world, port, cfg, q):
    try:
        q.put(("ok", rank, _check(rank, world, port)))
    except BaseException:  # noqa: BLE001 - the parent raises it
        q.put(("error", rank, traceback.format_exc()))


def test_two_ranks_train_like_eager():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from magis_nb.bench.ddp import run_ranks

    outs = run_ranks(_worker, WORLD, {}, timeout=300)
    for rank, out in enumerate(outs):
        assert out["diff"] < float("inf"), f"rank {rank}: the plan's weights differ from eager's"
        assert out["wrapped_diff"] < float("inf"), \
            f"rank {rank}: the DDP-wrapped plain plan's weights differ from eager's"
        assert "_comm.bucket(" in out["code"]
        assert "_comm" not in out["plain_code"].split("\n", 1)[0]
        recs = out["records"]
        buckets = sorted({r[0] for r in recs})
        assert len(buckets) >= 2, buckets                  # the small cap split the gradients
        assert len(recs) == STEPS * len(buckets)
        assert all(issued <= w0 <= w1 for _, _, issued, w0, w1 in recs)
    # every rank ran the same plan: the same code and bucket layout
    assert outs[0]["code"] == outs[1]["code"]
    assert [r[:2] for r in outs[0]["records"]] == [r[:2] for r in outs[1]["records"]]
