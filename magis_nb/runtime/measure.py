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

from ..capture.export import plain_tensors


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
    allocated: int = 0  # CUDA: the same peak in the blocks the allocator handed out
    reserved: int = 0   # CUDA: the allocator's reserved bytes at their peak


def measure_cpu(fn: Callable[[], object], baseline_tensors: Iterable[torch.Tensor]) -> Measurement:
    """Run ``fn`` once under the tracker; peak = baseline storages + tracked peak."""
    base = storage_bytes(baseline_tensors)
    tracker = MemoryTracker()
    with tracker:
        result = fn()
    return Measurement(base + tracker.peak, base, result)


def measure_cuda(fn: Callable[[], object], baseline_tensors: Iterable[torch.Tensor] = (),
                 device=None) -> Measurement:
    """Peak device memory of ``fn`` on CUDA, counting of what was allocated before
    only ``baseline_tensors`` (a reference copy of the model, earlier results
    are not the step's).

    ``peak`` is in the bytes the step asked the caching allocator for (its
    ``requested_bytes``): what the simulator models. ``allocated`` is the same
    peak in the blocks the allocator handed out, which are rounded up to 512 B
    and, in its large pool, keep an unsplit rest of up to 1 MiB of a cached block
    they reuse (docs/gpu.md: the first GPU run measured only this count)."""
    torch.cuda.synchronize(device)
    base = storage_bytes(baseline_tensors)
    st = torch.cuda.memory_stats(device)
    req0 = st["requested_bytes.all.current"] - base
    alloc0 = st["allocated_bytes.all.current"] - base
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    st = torch.cuda.memory_stats(device)
    return Measurement(st["requested_bytes.all.peak"] - req0, base, result,
                       allocated=st["allocated_bytes.all.peak"] - alloc0,
                       reserved=st["reserved_bytes.all.peak"])


def model_baseline(model: torch.nn.Module, inputs) -> list[torch.Tensor]:
    """The tensors a training step finds alive: parameters, grads, buffers (and
    tensors held as plain attributes), inputs
    (the tensors anywhere in ``inputs``: a tuple, a dict batch)."""
    ts = list(model.parameters()) + list(model.buffers())
    ts += [t for _, t in plain_tensors(model)]      # Note [plain tensor attributes]
    ts += [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    ts += [p.grad for p in model.parameters() if p.grad is not None]
    return ts


class CudaOpPeaks(TorchDispatchMode):
    """Per ATen op on a CUDA device, in the bytes asked of the caching allocator:
    before and after the op, the peak while it ran, and its new output storages.
    What an op takes beyond its outputs (``scratch``: cuBLAS/cuDNN workspace, a
    reduction's staging buffer) or keeps after returning that is not an output
    (``kept``) is what the simulator cannot see; ``overhead`` is what the blocks
    handed out for it came to beyond the bytes asked (`measure_cuda`). The rows
    explain a measured peak above the simulated one (`bench gpu`'s simcheck)."""

    def __init__(self, device=None):
        super().__init__()
        self.device = device
        self.rows: list[dict] = []

    def _now(self) -> tuple[int, int, int]:
        st = torch.cuda.memory_stats(self.device)
        return (st["requested_bytes.all.current"], st["requested_bytes.all.peak"],
                st["allocated_bytes.all.current"])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before_ptrs = {t.untyped_storage().data_ptr()
                       for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        torch.cuda.reset_peak_memory_stats(self.device)
        before, _, alloc0 = self._now()
        out = func(*args, **kwargs)
        after, peak, alloc1 = self._now()
        outs = storage_bytes(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                             and t.untyped_storage().data_ptr() not in before_ptrs)
        self.rows.append({"op": str(func), "before": before, "after": after, "peak": peak,
                          "outputs": outs, "scratch": peak - after,
                          "kept": after - before - outs,
                          "overhead": (alloc1 - alloc0) - (after - before)})
        return out

    def summary(self, top: int = 3) -> dict:
        """The step's peak and where it was reached; the ops with the most scratch,
        the most kept bytes and the most block overhead."""
        if not self.rows:
            return {}
        at = max(range(len(self.rows)), key=lambda i: self.rows[i]["peak"])

        def brief(r):
            return {k: r[k] for k in ("op", "outputs", "scratch", "kept", "overhead")}

        def most(key):
            return [brief(r) for r in sorted(self.rows, key=lambda r: -r[key])[:top] if r[key] > 0]

        return {"peak": self.rows[at]["peak"], "peak_op": brief(self.rows[at]), "peak_index": at,
                "ops": len(self.rows), "scratch": most("scratch"), "kept": most("kept"),
                "overhead": most("overhead")}
