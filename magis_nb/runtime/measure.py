"""Measured peak memory: a CPU storage tracker and the CUDA allocator's counters.

The CPU tracker is a TorchDispatchMode: every op's outputs are inspected, each
untyped storage that did not exist among the op's inputs is a new allocation and
counted once; a weakref finalizer on the storage subtracts it when it dies. It sees
the tensors a program holds, not a kernel's internal scratch space -- exactly what
the simulator models. Storages that exist before the measured region (weights,
inputs, existing .grad) are the caller's baseline.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key not in seen and st.nbytes() > 0:
            seen.add(key)
            total += st.nbytes()
    return total


class MemoryTracker(TorchDispatchMode):
    """Peak bytes of storages allocated while the mode is active."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = {t.untyped_storage().data_ptr()
                  for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key, size = st.data_ptr(), st.nbytes()
            if size == 0 or key in before or key in self.live:
                continue
            self.live[key] = size
            self.current += size
            weakref.finalize(st, self._free, key)
        self.peak = max(self.peak, self.current)
        return out


@dataclass
class Measurement:
    peak: int           # baseline + tracked peak
    baseline: int       # bytes live before the call (weights, buffers, inputs, grads)
    result: object = None


def measure_cpu(fn: Callable[[], object], baseline_tensors: Iterable[torch.Tensor]) -> Measurement:
    """Run ``fn`` once under the tracker; peak = baseline storages + tracked peak."""
    base = storage_bytes(baseline_tensors)
    tracker = MemoryTracker()
    with tracker:
        result = fn()
    return Measurement(base + tracker.peak, base, result)


def measure_cuda(fn: Callable[[], object], device=None) -> Measurement:
    """Peak of the CUDA caching allocator's allocated bytes during ``fn``."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return Measurement(torch.cuda.max_memory_allocated(device), base, result)


def model_baseline(model: torch.nn.Module, inputs) -> list[torch.Tensor]:
    """The tensors a training step finds alive: parameters, grads, buffers, inputs
    (the tensors anywhere in ``inputs``: a tuple, a dict batch)."""
    ts = list(model.parameters()) + list(model.buffers())
    ts += [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    ts += [p.grad for p in model.parameters() if p.grad is not None]
    return ts


class CudaOpPeaks(TorchDispatchMode):
    """Per ATen op on a CUDA device: the allocator's bytes before and after the op,
    the peak while it ran, and the bytes of its new output storages. What an op
    takes beyond its outputs (``scratch``: cuBLAS/cuDNN workspace, a reduction's
    staging buffer) or keeps after returning that is not an output (``kept``) is
    what the simulator cannot see: the rows that explain a measured peak above the
    simulated one (`bench gpu`'s simcheck)."""

    def __init__(self, device=None):
        super().__init__()
        self.device = device
        self.rows: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before_ptrs = {t.untyped_storage().data_ptr()
                       for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = func(*args, **kwargs)
        after = torch.cuda.memory_allocated(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        outs = storage_bytes(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                             and t.untyped_storage().data_ptr() not in before_ptrs)
        self.rows.append({"op": str(func), "before": before, "after": after, "peak": peak,
                          "outputs": outs, "scratch": peak - after,
                          "kept": after - before - outs})
        return out

    def summary(self, top: int = 3) -> dict:
        """The step's peak and where it was reached; the ops with the most scratch
        and the most kept bytes."""
        if not self.rows:
            return {}
        at = max(range(len(self.rows)), key=lambda i: self.rows[i]["peak"])

        def brief(r):
            return {k: r[k] for k in ("op", "outputs", "scratch", "kept")}

        return {"peak": self.rows[at]["peak"], "peak_op": brief(self.rows[at]), "peak_index": at,
                "ops": len(self.rows),
                "scratch": [brief(r) for r in sorted(self.rows, key=lambda r: -r["scratch"])[:top]],
                "kept": [brief(r) for r in sorted(self.rows, key=lambda r: -r["kept"])[:top]
                         if r["kept"] > 0]}
