"""A stand-in for the CUDA stream calls `CudaCopies` makes, on the CPU.

It runs the generated program's CUDA copy path (`runtime.copies.CudaCopies`
with ``streams=StandInStreams()``) and checks the protocol a GPU would hold it
to, as late as a GPU may run the work:

- the compute stream runs at once (the host runs the program's ops as they come);
- the copy stream's copies are only queued, and run when the compute stream
  waits for an event recorded after them (``wait_event``) or for the whole copy
  stream (``wait_stream``): a copy the program did not wait for has not happened,
  so a Load read before ``ready`` reads its destination's poison (NaN, or -7 for
  integers) and the result is wrong;
- a queued copy holds its tensors' storages weakly: one the program freed (no
  tensor or view of it left) before the copy ran is a `violations` entry,
  "freed while a copy reads it" (on a GPU its block would have gone back to the
  allocator while the copy stream used it);
- `log` lists every call in order, for tests of where waits go.
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch.utils._python_dispatch import _disable_current_modes

from magis_nb.runtime.copies import copy_layout


class StandInStream:
    def __init__(self, owner: "StandInStreams", name: str):
        self.owner, self.name = owner, name
        self.queue: list = []           # ("copy", dst ref, src ref, what) | ("event", event)

    def __repr__(self) -> str:
        return f"<{self.name} stream>"

    def wait_stream(self, other: "StandInStream") -> None:
        self.owner.log.append(("wait_stream", self.name, other.name))
        if self is self.owner.compute:
            other.run_until(None)
        # the copy stream waiting for compute: compute has run already

    def wait_event(self, ev: "StandInEvent") -> None:
        self.owner.log.append(("wait_event", self.name, ev.name))
        if self is self.owner.compute and ev.stream is not None and ev.stream is not self:
            ev.stream.run_until(ev)

    def run_until(self, ev) -> None:
        """Run the queued work up to ``ev`` (everything for None)."""
        while self.queue:
            item = self.queue.pop(0)
            if item[0] == "event":
                item[1].happened = True
                if item[1] is ev:
                    return
                continue
            _, dst, src, what = item
            d, s = dst.tensor(), src.tensor()
            if d is None or s is None:
                self.owner.violations.append(f"{what}: {'destination' if d is None else 'source'} "
                                             "freed while a copy reads it")
                continue
            copy_layout(d, s)
            self.owner.log.append(("copied", what))


class _Weak:
    """A tensor by weak references (tensor objects die with views of them
    alive: the storage is what a GPU's block is)."""

    def __init__(self, t: torch.Tensor):
        self.obj = weakref.ref(t)
        self.storage = weakref.ref(t.untyped_storage())
        self.meta = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def tensor(self) -> torch.Tensor | None:
        t = self.obj()
        if t is not None:
            return t
        st = self.storage()
        if st is None:
            return None
        off, shape, stride, dtype = self.meta
        # made outside any dispatch mode: a step's storage tracker (runtime/
        # measure.py) would count the old storage as a new allocation
        with _disable_current_modes():
            return torch.empty(0, dtype=dtype).set_(st, off, shape, stride)


class StandInEvent:
    def __init__(self, owner: "StandInStreams", name: str):
        self.owner, self.name = owner, name
        self.stream: StandInStream | None = None
        self.happened = False

    def record(self, stream: StandInStream | None = None) -> None:
        stream = stream or self.owner.compute
        self.stream, self.happened = stream, False
        self.owner.log.append(("record", self.name, stream.name))
        if stream is self.owner.compute:
            self.happened = True         # compute runs at once
        else:
            stream.queue.append(("event", self))


class StandInStreams:
    """`runtime.copies.CudaStreams`' members, recording and checking."""

    def __init__(self):
        self.log: list[tuple] = []
        self.violations: list[str] = []
        self.compute = StandInStream(self, "compute")
        self._copy_streams: list[StandInStream] = []
        self._events = 0

    def Stream(self, device) -> StandInStream:          # noqa: N802 - torch.cuda's name
        s = StandInStream(self, f"copy{len(self._copy_streams)}")
        self._copy_streams.append(s)
        return s

    def Event(self, enable_timing: bool = False) -> StandInEvent:   # noqa: N802
        self._events += 1
        return StandInEvent(self, f"e{self._events}")

    def current_stream(self, device) -> StandInStream:
        return self.compute

    def copy(self, stream: StandInStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        what = f"copy {len(self.log)}"
        self.log.append(("issue", what, stream.name))
        if stream is self.compute:
            copy_layout(dst, src)
            return
        stream.queue.append(("copy", _Weak(dst), _Weak(src), what))

    def empty_strided(self, shape, stride, dtype, device) -> torch.Tensor:
        y = torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
        # poison over the span (gaps included), so an early read shows
        with contextlib.suppress(RuntimeError):
            y.as_strided((1 + sum((a - 1) * b for a, b in zip(shape, stride)),) if y.numel() else (0,),
                         (1,)).fill_(math.nan if y.is_floating_point() else -7)
        return y

    def pending(self) -> int:
        """Copies queued and not run."""
        return sum(1 for s in self._copy_streams for it in s.queue if it[0] == "copy")
