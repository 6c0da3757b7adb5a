"""The runtime side of gradient buckets, and the link they travel over.

``BucketComm`` is what a bucketed program's ``_comm`` keyword receives
(`buckets`): ``bucket(k, grads)`` copies a bucket's gradients into one flat tensor
and issues its ``all_reduce(async_op=True)`` on the process group; ``finish()``
waits for every handle and divides by the world size (DDP's average), before the
program returns. With ``record=True`` it keeps, per bucket and step, the times of
issue and of the wait (`hidden_fraction`).

``LocalComm`` runs the same program in one process (world size 1, no
communication): the search's checks against eager run every candidate plan on
one rank alone, which a collective would deadlock.

``CommLink`` prices an all_reduce: a ring moves 2(w-1)/w of the bytes over the
slowest link, plus a fixed latency per call. ``measure_link`` fits it on the
process group itself (a collective: every rank calls it); ``LINKS`` are nominal
links for planning a GPU cluster from here.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .buckets import DEFAULT_CAP, bucket_copy


@dataclass(frozen=True)
class CommLink:
    bandwidth: float          # bytes/s per direction of the slowest link in the ring
    latency: float            # seconds per all_reduce call
    world: int                # ranks
    label: str = ""

    def allreduce_cost(self, nbytes: int) -> float:
        if self.world <= 1 or nbytes <= 0:
            return 0.0
        return self.latency + 2 * (self.world - 1) / self.world * nbytes / self.bandwidth


# Nominal per-direction bandwidths (vendor figures, not measured here).
LINKS = {
    "nvlink": dict(bandwidth=50e9, latency=20e-6),      # RTX 3090 NVLink bridge: 56 GB/s
    "pcie": dict(bandwidth=12e9, latency=30e-6),        # PCIe 4.0 x16 through host memory
    "ethernet": dict(bandwidth=1.1e9, latency=100e-6),  # 10 GbE
}


def nominal_link(name: str, world: int) -> CommLink:
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; use one of {', '.join(LINKS)}")
    return CommLink(world=world, label=name, **LINKS[name])


def measure_link(group=None, device: torch.device | str = "cpu", reps: int = 5) -> CommLink:
    """All_reduce latency and bandwidth fitted on ``group`` (every rank must call
    this): the median time of a small and a large all_reduce, the slowest rank's."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    sizes = (64 * 2**10, 8 * 2**20)
    times = []
    for n in sizes:
        x = torch.zeros(n // 4, dtype=torch.float32, device=device)
        dist.all_reduce(x, group=group)                  # warm-up
        ts = []
        for _ in range(reps):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            ts.append(time.perf_counter() - t0)
        times.append(statistics.median(ts))
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)   # one link on every rank
    (t_small, t_large) = t.tolist()
    moved = 2 * (world - 1) / world
    bw = moved * (sizes[1] - sizes[0]) / max(t_large - t_small, 1e-9)
    lat = max(t_small - moved * sizes[0] / bw, 0.0)
    return CommLink(bandwidth=bw, latency=lat, world=world, label=f"measured {dist.get_backend(group)}")


@dataclass(frozen=True)
class DataParallel:
    """A plan for data parallel training: its buckets' all_reduces run on
    ``group`` (None: the default group) over ``link``, ``cap`` bytes a bucket."""
    group: object
    link: CommLink
    cap: int = DEFAULT_CAP


@dataclass
class BucketRecord:
    bucket: int
    nbytes: int
    issued: float             # perf_counter when the all_reduce was issued
    wait_start: float
    wait_end: float


class LocalComm:
    """Buckets without communication: the program as one rank alone runs it."""

    def bucket(self, k: int, grads) -> torch.Tensor:
        return bucket_copy(grads)

    def finish(self) -> None:
        pass


@dataclass
class BucketComm:
    group: object = None
    record: bool = False
    records: list = field(default_factory=list)

    def __post_init__(self):
        import torch.distributed as dist

        self._dist = dist
        self.world = dist.get_world_size(self.group)
        self._pending: list = []

    def bucket(self, k: int, grads) -> torch.Tensor:
        flat = bucket_copy(grads)
        handle = self._dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending.append((k, flat, handle, time.perf_counter()))
        return flat

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        for k, flat, handle, issued in pending:
            w0 = time.perf_counter()
            handle.wait()
            w1 = time.perf_counter()
            flat.div_(self.world)
            if self.record:
                self.records.append(BucketRecord(k, flat.numel() * flat.element_size(), issued, w0, w1))
