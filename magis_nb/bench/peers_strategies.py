"""The strategies `bench peers` compares: each maps a zoo case to `Candidate`s.

eager: PyTorch as written. checkpoint: `torch.utils.checkpoint` (non-reentrant)
around each block. compile: `torch.compile` (inductor) with
`torch._functorch.config.activation_memory_budget`. rockmate: Rockmate from PyPI,
if it imports. magis: `magis_nb.optimize`, every point of a spread of its Pareto
front. magis+inductor: the same, each plan's generated program compiled by
inductor (peers_compile.py). Every candidate trains the case's own parameters or a copy of them from
the same initial state, so its loss and gradients can be held against eager's.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..capture import LossModule, eager_step
from ..capture.outputs import find_loss
from ..rules.swap import pool_inputs
from .peers_harness import Candidate

# Blocks to checkpoint, as module paths ("*": every child of a ModuleList/Sequential).
BLOCKS = {"unet": ("inc", "down.*", "dec.*"), "gpt": ("blocks.*",), "vit": ("blocks.*",),
          "bert": ("layers.*",), "llama": ("blocks.*",), "hf-llama": ("lm.model.layers.*",)}
COMPILE_BUDGETS = (1.0, 0.5, 0.2, 0.0)


def fresh_copy(case) -> nn.Module:
    """A deep copy of the case's model, without gradients."""
    m = copy.deepcopy(case.model)
    for p in m.parameters():
        p.grad = None
    return m


def _cand(setting, step, model, **kw) -> Candidate:
    return Candidate(setting, step, list(model.parameters()), list(model.buffers()), **kw)


def eager(case) -> list[Candidate]:
    m = fresh_copy(case)
    return [_cand("", lambda: eager_step(m, case.inputs, case.loss_fn, "train"), m)]


class Checkpointed(nn.Module):
    """Runs ``inner`` under non-reentrant activation checkpointing (RNG state replayed)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def wrap_blocks(model: nn.Module, patterns) -> int:
    """Wrap every module matched by ``patterns`` in `Checkpointed`; returns how many."""
    n = 0
    for pat in patterns:
        parent_path, _, last = pat.rpartition(".")
        if last == "*":
            parent = model.get_submodule(parent_path)
            names = list(parent._modules)
        else:
            parent = model.get_submodule(parent_path) if parent_path else model
            names = [last]
        for name in names:
            # Keeps the parameter order: replacing an existing entry keeps its position.
            parent._modules[name] = Checkpointed(parent._modules[name])
            n += 1
    return n


def checkpointed(case) -> list[Candidate]:
    m = fresh_copy(case)
    params, buffers = list(m.parameters()), list(m.buffers())
    n = wrap_blocks(m, BLOCKS[case.name])
    step = lambda: eager_step(m, case.inputs, case.loss_fn, "train")  # noqa: E731
    return [Candidate(f"{n} blocks", step, params, buffers)]


def compiled(budget: float, backend: str = "inductor"):
    """torch.compile at one activation_memory_budget (set before the first call,
    which is when AOTAutograd partitions forward and backward)."""

    def make(case) -> list[Candidate]:
        import torch._functorch.config as fconfig
        import torch._inductor.config as iconfig

        fconfig.activation_memory_budget = budget
        iconfig.fallback_random = True  # dropout draws eager's masks (allclose is checkable)
        m = fresh_copy(case)
        fn = torch.compile(LossModule(m, case.loss_fn), backend=backend)

        def step():
            loss = fn(*case.inputs)[0]
            loss.backward()
            return loss.detach()

        return [_cand(f"budget={budget}", step, m, trackable=False, forward=lambda: fn(*case.inputs),
                      note="" if backend == "inductor" else f"backend={backend}")]

    return make


def rockmate(case) -> list[Candidate]:
    """Rockmate (rkgb + rockmate from PyPI). Raises with its own message if it
    does not import or does not build a module on this machine."""
    from rockmate import Rockmate  # noqa: F401  (ImportError is the recorded reason)

    m = fresh_copy(case)
    t0 = time.perf_counter()
    rk = Rockmate(m, case.inputs[:-1] if case.loss_fn else case.inputs, budget=None)
    prep = time.perf_counter() - t0

    def step():
        out = rk(*case.inputs[:-1]) if case.loss_fn else rk(*case.inputs)
        loss = case.loss_fn(out, case.inputs[-1]) if case.loss_fn else find_loss(out)
        loss.backward()
        return loss.detach()
    return [_cand("", step, m, prep_s=prep)]


def spread(plans: list, k: int, key=lambda p: p.peak) -> list:
    """At most ``k`` plans of a front sorted by ``key`` (the peak): both ends, and
    between them the plans nearest to evenly spaced peaks. Plans with the same
    peak count once (the first, the faster on a front): measuring both would
    spend a point on one peak and leave a stretch of the front unmeasured."""
    uniq = []
    for p in plans:
        if not uniq or key(p) != key(uniq[-1]):
            uniq.append(p)
    if len(uniq) <= k:
        return uniq
    lo, hi = key(uniq[0]), key(uniq[-1])
    chosen: list[int] = []
    for i in range(k):
        target = lo + (hi - lo) * i / (k - 1)
        free = [j for j in range(len(uniq)) if j not in chosen]
        chosen.append(min(free, key=lambda j: (abs(key(uniq[j]) - target), j)))
    return [uniq[j] for j in sorted(chosen)]


def magis(time_budget: float, points: int, lat_budget: float = 1.10, backend: str | None = None,
          swap: bool = False):
    """One search (lowest peak within ``lat_budget``), then up to ``points`` plans
    of its Pareto front, each a candidate (its search time is every one's prep_s).
    ``backend``: compile each plan's program with it (`peers_compile.compile_plan`;
    the first step compiles, as for torch.compile), from a search without fission.
    ``swap``: plans for a GPU, whose swapped bytes live in host buffers; on the CPU
    those stay in the process, so their peak is a GPU's memory on a stand-in, not
    comparable with the peers' process memory (`bench peers` keeps them apart)."""

    def make(case) -> list[Candidate]:
        from ..search import optimize

        if backend is not None:
            import torch._inductor.config as iconfig

            iconfig.fallback_random = True  # eager's dropout masks, as for the compile peers

        t0 = time.perf_counter()
        # Compiled plans keep every region whole: inductor re-plans a split
        # program's buffers across its parts (tiny GPT split in 8: 228 MB compiled
        # against 50 MB as generated, see `optimize(fission=...)`).
        # Note [which memory] in search.report: without swaps a plan's peak is the
        # process's, as every peer's is
        res = optimize(case.model, case.inputs, loss_fn=case.loss_fn, lat_budget=lat_budget,
                       time_budget=time_budget, fission=backend is None, swap=swap)
        prep = time.perf_counter() - t0
        params, buffers = list(case.model.parameters()), list(case.model.buffers())
        out = []
        front = spread(sorted(res.pareto, key=lambda p: (p.peak, p.latency)), points)
        for i, plan in enumerate(front):
            step, release, host, extra = _lazy_plan(res, plan, case.inputs, backend)
            out.append(Candidate(
                f"plan {i + 1}/{len(front)}", step, params, buffers,
                prep_s=prep, note=plan.applied, trackable=backend is None, release=release,
                extra={**extra, "sim_peak": plan.peak, "sim_latency": plan.latency,
                       "sim_peak_ratio": round(plan.peak / res.before.peak, 4),
                       "sim_lat_ratio": round(plan.latency / res.before.latency, 4),
                       "host_bytes": host, "pareto_size": len(res.pareto), "states": res.states}))
        return out

    return make


def _lazy_plan(res, plan, inputs, backend):
    """(step, release, host bytes, extra) of one plan. Its module (host buffers,
    compiled code) is built at the first step and dropped by ``release``, so only
    the plan being measured is alive: modules piling up change the process's
    memory and the timings made in it (see `OptimizeResult.fit_measured`)."""
    host = sum(n.outputs[0].nbytes for n in pool_inputs(plan.state.graph))
    extra = {"opaque": {}} if backend is not None else {}   # filled by the compiling step
    live = {}

    def step():
        if "mod" not in live:
            mod = res.module_for(plan)
            if backend is not None:
                from .peers_compile import compile_plan

                compile_plan(mod, backend, log=extra["opaque"])
            live["mod"] = mod
        return live["mod"].step(*inputs)

    def release():
        live.clear()
        res.drop_module(plan)

    return step, release, host, extra


def strategies(magis_time: float = 60.0, magis_points: int = 6, backend: str = "inductor"):
    """name -> [(setting key, make)]; the setting key picks one run of `bench peers`."""
    return {
        "eager": [("", eager)],
        "checkpoint": [("", checkpointed)],
        "compile": [(str(b), compiled(b, backend)) for b in COMPILE_BUDGETS],
        "rockmate": [("", rockmate)],
        "magis": [("", magis(magis_time, magis_points))],
        "magis+inductor": [("", magis(magis_time, magis_points, backend=backend))],
        "magis-gpu": [("", magis(magis_time, magis_points, swap=True))],
    }
