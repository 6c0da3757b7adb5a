"""How a generated program moves swapped tensors to the host and back.

The generated code (see `codegen`) calls five methods of an ``io`` object:

- ``store(k, pool, x)`` right after ``x``'s producer: start copying ``x`` into
  its host buffer ``pool`` (swap ``k``).
- ``stored(k, pool)`` at the Store's place in the plan's order: the program
  goes on only once the copy is done (returns ``pool``); ``x`` may be deleted
  from here, and its memory is free for the next op, as the simulator frees it
  (Note [a Store's free point]).
- ``load(k, pool, dev)`` where the plan issues the Load: returns a new tensor on
  ``dev`` that receives ``pool``'s contents.
- ``ready(k)`` just before the first op that reads the loaded tensor.
- ``finish()`` before the program returns.

`SyncCopies` (CPU, or any device without streams) copies at once; `CudaCopies`
issues the copies on a dedicated copy stream and makes the compute stream wait
only where a loaded tensor is first read, so transfers overlap compute as the
plan's latency model assumes. `TimedCudaCopies` also times every transfer and
every wait with CUDA events: how much transfer time compute actually waited for;
`TimedSyncCopies` times the CPU's copies with the host clock.

Layout is semantics (DESIGN.md §11): the program's views were traced against the
strides the swapped tensor had, so a host buffer is allocated with those strides
(`host_buffer`) and a loaded copy gets them too. A dense layout (a permutation of
a contiguous one: ``scaled_dot_product_attention``'s output, a ``transpose``)
copies element by element as usual; a layout with gaps or overlaps (an expanded
tensor) copies the memory span it covers (`copy_layout`), since ``copy_`` cannot
write into overlapping elements and ``_to_copy`` would return a contiguous tensor.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

aten = torch.ops.aten


def is_dense(shape, stride) -> bool:
    """Non-overlapping and dense: the strides are a permutation of contiguous
    ones (size-1 dims ignored). Such a layout survives ``_to_copy`` and
    ``empty_like`` (preserve_format); any other comes back contiguous."""
    expect = 1
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
        if st != expect:
            return False
        expect *= sz
    return True


def _span(t: torch.Tensor) -> torch.Tensor:
    """A 1-d view of the memory ``t`` covers (gaps and overlaps included)."""
    if t.numel() == 0:
        return t.reshape(0)
    n = 1 + sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))
    return t.as_strided((n,), (1,), t.storage_offset())


def host_buffer(shape, stride, dtype, pin: bool = False) -> torch.Tensor:
    """The host buffer of a swapped tensor: its shape *and* its strides (contiguous
    when the strides are unknown)."""
    if stride is None:
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    return torch.empty_strided(shape, stride, dtype=dtype, pin_memory=pin)


def copy_layout(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``; when both have the same layout with gaps or overlaps,
    the memory span they cover instead (``copy_`` refuses overlapping targets)."""
    if dst.stride() == src.stride() and dst.shape == src.shape \
            and not is_dense(dst.shape, dst.stride()):
        _span(dst).copy_(_span(src), non_blocking=non_blocking)
    else:
        dst.copy_(src, non_blocking=non_blocking)


def match_layout(pool: torch.Tensor, x: torch.Tensor) -> None:
    """Give ``pool`` the strides of the tensor stored into it, in place, if they
    differ (a tensor a rewrite made, whose strides the graph did not record, or
    a kernel that lays out its output otherwise than its meta function said):
    the Load then returns ``x``'s layout and views of it stay valid. The buffer
    keeps its storage; a layout whose span does not fit in it is left alone."""
    if pool.stride() == x.stride() or pool.shape != x.shape:
        return
    need = (1 + sum((sz - 1) * st for sz, st in zip(x.shape, x.stride()))) if x.numel() else 0
    if need * pool.element_size() <= pool.untyped_storage().nbytes():
        pool.as_strided_(x.shape, x.stride(), 0)


def load_like(pool: torch.Tensor, dev) -> torch.Tensor:
    """A copy of ``pool`` on ``dev`` with ``pool``'s strides."""
    if is_dense(pool.shape, pool.stride()):
        # _to_copy always copies (Tensor.to would return ``pool`` itself on the
        # CPU) and keeps a dense layout (memory_format=preserve)
        return aten._to_copy.default(pool, device=dev)
    y = torch.empty_strided(pool.shape, pool.stride(), dtype=pool.dtype, device=dev)
    copy_layout(y, pool)
    return y


class SyncCopies:
    """Copies that are done when the call returns (the CPU's only kind)."""

    def store(self, k: int, pool: torch.Tensor, x: torch.Tensor) -> None:
        match_layout(pool, x)
        copy_layout(pool, x)

    def stored(self, k: int, pool: torch.Tensor) -> torch.Tensor:
        return pool

    def load(self, k: int, pool: torch.Tensor, dev) -> torch.Tensor:
        return load_like(pool, dev)

    def ready(self, k: int) -> None:
        pass

    def finish(self) -> None:
        pass


SYNC = SyncCopies()


class CudaStreams:
    """The stream calls `CudaCopies` makes, as torch.cuda makes them. A stand-in
    with the same five members (tests/cuda_standin.py) runs the same protocol on
    the CPU and checks it."""
    Stream = staticmethod(lambda device: torch.cuda.Stream(device))
    Event = staticmethod(lambda enable_timing=False: torch.cuda.Event(enable_timing=enable_timing))
    current_stream = staticmethod(lambda device: torch.cuda.current_stream(device))

    @staticmethod
    def copy(stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue ``dst.copy_(src)`` on ``stream``, not waited for."""
        with torch.cuda.stream(stream):
            copy_layout(dst, src, non_blocking=True)

    @staticmethod
    def empty_strided(shape, stride, dtype, device) -> torch.Tensor:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)


# Note [a Store's free point]
# A stored tensor's memory is free at the Store's place in the plan's order:
# the memory simulator frees it there and the latency simulator makes the next
# compute op wait for the Store's copy (search/transfers.py). The runtime does
# the same: ``stored(k)`` makes the compute stream wait for Store k's event,
# and the program deletes the tensor after that line, so its block goes back to
# the compute stream's pool with every later op ordered after the copy. Before,
# ``x.record_stream(copy stream)`` and no wait: compute never stalled, but the
# caching allocator kept the block until the copy stream passed the free point,
# so a step could measure above the simulated peak, reserved memory grew, and
# under pressure the allocator synchronized the device; neither was modelled.
# Whether waiting or record_stream is faster on a GPU is not measured yet
# (issue 56); the runtime now does what the plan was priced and sized for.


class CudaCopies:
    """Asynchronous Stores and Loads on one copy stream of ``device``.

    Ordering, without a host-blocking synchronize anywhere:

    - Store: the copy stream waits for the compute stream (``x`` is computed),
      copies into the pinned buffer and records an event; ``stored`` makes the
      compute stream wait on it at the Store's place in the order, before the
      program frees ``x`` (Note [a Store's free point]).
    - Load: the destination is allocated on the compute stream (so its block
      returns to the compute stream's pool when the program frees it); the copy
      stream waits for the compute stream up to here (earlier ops may still use
      that block), copies, and records an event that ``ready`` makes the compute
      stream wait on.
    - One copy stream runs the transfers one at a time, in issue order, as the
      latency simulation models them; a Store into a buffer is ordered after the
      previous call's Load from it.

    ``streams``: the stream calls (`CudaStreams`; a stand-in in the tests).
    """

    def __init__(self, n: int, device, streams=CudaStreams):
        self.device = torch.device(device)
        self.api = streams
        self.stream = streams.Stream(self.device)
        self.done = [streams.Event() for _ in range(n)]     # Load k copied
        self.kept = [streams.Event() for _ in range(n)]     # Store k copied

    def _compute(self):
        return self.api.current_stream(self.device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One transfer, issued on the copy stream."""
        self.api.copy(self.stream, dst, src)

    def _wait(self, k, wait) -> None:
        """Make compute wait (``wait``); ``k``: the Load, ("store", k) for a
        Store, -1 for finish."""
        wait()

    def store(self, k: int, pool: torch.Tensor, x: torch.Tensor) -> None:
        match_layout(pool, x)       # metadata only: before the copy is issued
        self.stream.wait_stream(self._compute())
        self._copy(pool, x)
        self.kept[k].record(self.stream)

    def stored(self, k: int, pool: torch.Tensor) -> torch.Tensor:
        self._wait(("store", k), lambda: self._compute().wait_event(self.kept[k]))
        return pool

    def load(self, k: int, pool: torch.Tensor, dev) -> torch.Tensor:
        # the swapped tensor's strides (the buffer's: see `host_buffer`)
        y = self.api.empty_strided(pool.shape, pool.stride(), pool.dtype, self.device)
        self.stream.wait_stream(self._compute())
        self._copy(y, pool)
        self.done[k].record(self.stream)
        return y

    def ready(self, k: int) -> None:
        self._wait(k, lambda: self._compute().wait_event(self.done[k]))

    def finish(self) -> None:
        # results (and the next call's reuse of the buffers) follow every copy
        self._wait(-1, lambda: self._compute().wait_stream(self.stream))


@dataclass
class TransferStats:
    """Times of one step's transfers and of compute's waits for them (CUDA events;
    the host clock for the CPU's synchronous copies)."""
    transfer_s: float = 0.0         # copy stream busy with Stores and Loads
    stall_s: float = 0.0            # compute stream waiting in ready()/finish()
    copies: int = 0
    waits: list = field(default_factory=list)   # (Load k, ("store", k) or -1, seconds)

    @property
    def hidden(self) -> float:
        """Fraction of transfer time that compute did not wait for."""
        if self.transfer_s <= 0:
            return 1.0
        return max(0.0, 1.0 - self.stall_s / self.transfer_s)


class TimedCudaCopies(CudaCopies):
    """`CudaCopies` with timing events around every copy and every wait.

    A wait's stall is the time between an event recorded on the compute stream
    just before ``wait_event`` and one just after it: zero when the copy was
    already done, else how long compute sat idle for it. Call `stats()` after
    the step (it synchronizes).
    """

    def __init__(self, n: int, device, streams=CudaStreams):
        super().__init__(n, device, streams)
        self._copy_ev: list[tuple] = []
        self._wait_ev: list[tuple] = []

    def _ev(self):
        return self.api.Event(enable_timing=True)

    def _copy(self, dst, src):
        a, b = self._ev(), self._ev()
        a.record(self.stream)
        super()._copy(dst, src)
        b.record(self.stream)
        self._copy_ev.append((a, b))

    def _wait(self, k, wait):
        a, b = self._ev(), self._ev()
        a.record(self._compute())
        wait()
        b.record(self._compute())
        self._wait_ev.append((k, a, b))

    def stats(self) -> TransferStats:
        torch.cuda.synchronize(self.device)
        st = TransferStats()
        for a, b in self._copy_ev:
            st.transfer_s += a.elapsed_time(b) / 1e3
        for k, a, b in self._wait_ev:
            s = a.elapsed_time(b) / 1e3
            st.stall_s += s
            st.waits.append((k, s))
        st.copies = len(self._copy_ev)
        self._copy_ev.clear()
        self._wait_ev.clear()
        return st


class TimedSyncCopies(SyncCopies):
    """`SyncCopies` that time every copy with the host clock. On the CPU a copy
    runs on the compute stream: all of its time is a stall. `stats()` returns
    (and resets) what was copied since its last call."""

    def __init__(self):
        self._times: list[float] = []

    def store(self, k: int, pool: torch.Tensor, x: torch.Tensor) -> None:
        t0 = time.perf_counter()
        super().store(k, pool, x)
        self._times.append(time.perf_counter() - t0)

    def load(self, k: int, pool: torch.Tensor, dev) -> torch.Tensor:
        t0 = time.perf_counter()
        out = super().load(k, pool, dev)
        self._times.append(time.perf_counter() - t0)
        return out

    def stats(self) -> TransferStats:
        total = sum(self._times)
        st = TransferStats(transfer_s=total, stall_s=total, copies=len(self._times))
        self._times = []
        return st


def copies_for(device, n: int, *, timed: bool = False):
    """The copies object a program with ``n`` swaps uses on ``device``."""
    device = torch.device(device)
    if device.type == "cuda" and n:
        return (TimedCudaCopies if timed else CudaCopies)(n, device)
    return TimedSyncCopies() if timed else SYNC
