"""MeasuredCost: each distinct op signature timed once on the real device, cached
on disk (keyed by torch version, device and CPU/threads).

Note [timings taken on a busy CPU]
A timing is kept on disk for every later search on this machine, so one taken
while another process shares the cores lies for good: with two cores and two
torch threads each, OpenMP's barriers make a [4,128,32] x [4,32,2048] bmm take
9.2 ms instead of 0.42, and that one entry priced the zoo GPT's every-block plan
at 2048 tokens x1.86 of eager where it measures x0.8 (its 192 bmms: 1.8 s of a
2.3 s step). Two guards: an op's time is the least of its repetitions (the one
least disturbed), and on the CPU a canary (a small matmul at the same thread
count, its best time kept in the cache file) is timed before and after each op:
when it ran more than `BUSY` times its best, the machine was busy, and the
op's time serves this instance only and is not saved (the next search times
it again).

Note [a timing is confirmed once per process]
The canary misses load that slows an op less than `BUSY` times, or in bursts
between the canary's runs: in a cache filled while a test suite shared the two
cores, the tiny MLP's 80 split `addmm_` were priced 81 ms where they take 46
alone (the plan priced x1.59 of the unoptimized program, measured x0.91), and
tiny BERT's 13 `bernoulli_` 134 ms where they take 94 (the program priced 287
ms against 196 timed again, measured 248). So one timing is not trusted for
good: each process times an op read from the file once more on its first use
there, and the cache keeps the last `SAMPLES` such timings of every op (one per
process, each the least of its repetitions); the op's price is their median. The
lesser of the timings is no better: keeping it, tiny ViT's split `bmm`s drifted
to 30.2 ms a step where a fresh timing gives 64.6 and the step measures 52.0
(the least of many runs is a lucky one, not the op). A timing taken while the
canary says busy adds no sample. Each process pays for one timing of the ops
it prices (a few steps of the program, where a search prices hundreds of
states).

New timings are written to the file at most every SAVE_EVERY seconds (and by
`save`, which `optimize` calls at its end, and at exit): each write rewrites
the whole file, 0.1 s at 9,333 signatures, and a search that met a few
hundred new shapes (the parts of a causal split, each with its own number of
keys) spent tens of seconds of its budget writing.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import re
import statistics
import time
import weakref
from pathlib import Path
from typing import Sequence

from ..ir.graph import Graph, Node, Ref
from ..kernels import SUBSTITUTES, callable_for
from ..timing import call_seconds
from .cost import CostModel, RooflineCost, dtype_name, node_of
from .profiles import get_profile

SAVE_EVERY = 5.0      # seconds between writes of new timings from `op_cost`
SAMPLES = 5           # timings kept per op, one per process (Note [a timing is confirmed ...])
DIRTY: "weakref.WeakSet[MeasuredCost]" = weakref.WeakSet()
# (cache file, signature) timed in this process (Note [a timing is confirmed once per process])
CONFIRMED: set[tuple[str, str]] = set()


@atexit.register
def save_at_exit() -> None:
    for mc in list(DIRTY):
        try:
            mc.save()
        except OSError:
            pass


def _cache_dir(cache_dir) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("MAGIS_NB_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "magis_nb"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+]+", "_", s).strip("_")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "cpu"


def _tf32() -> tuple[bool, bool]:
    """Whether fp32 matmuls and cuDNN convolutions may use TF32 right now."""
    import torch
    return (torch.get_float32_matmul_precision() != "highest", bool(torch.backends.cudnn.allow_tf32))


def _profile_for_gpu(name: str) -> str:
    s = name.lower().replace(" ", "")
    for key, prof in (("3090", "rtx3090"), ("a100", "a100"), ("h100", "h100"), ("h200", "h200")):
        if key in s:
            return prof
    return "a100"


def _samples(v) -> list[float] | None:
    """A cache file's entry as its timings (None: the op cannot run)."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return [float(v)]
    try:
        return [float(x) for x in v] or None
    except (TypeError, ValueError):
        return None


def _entry(samples: list[float] | None):
    """Timings as a cache file's entry: one number, or the list of them."""
    if samples is None:
        return None
    return samples[0] if len(samples) == 1 else list(samples)


BUSY = 3.0         # canary slower than this many times its best: the CPU was shared
CANARY_N = 96      # the canary: a CANARY_N^2 fp32 matmul (tens of microseconds)


def _canary_of(data: dict) -> float | None:
    """The best canary time a cache file holds (None without one)."""
    try:
        got = data.get("canary")
        return float(got) if got else None
    except (TypeError, ValueError):
        return None


class MeasuredCost:
    """Each distinct op signature timed once on the real device, cached on disk.

    The signature is the target, every tensor argument's shape/dtype/stride and
    every other argument. Inputs are random floats; integer and bool tensors are
    zeros (valid indices for embedding, nll_loss targets, pooling indices). An op
    that cannot run (or has no ATen callable) falls back to ``fallback`` (a roofline
    on the local CPU, or on the closest GPU profile for CUDA) and is remembered as
    unrunnable (null in the JSON). The cache file is
    ``<cache_dir>/costs-<torch version>-<device tag>.json``; the cache dir is
    ``cache_dir``, else $MAGIS_NB_CACHE_DIR, else ~/.cache/magis_nb. On the CPU the
    device tag includes the CPU model and the torch thread count (timings depend on
    both); on CUDA the GPU's name and whether TF32 is allowed for matmuls and
    convolutions. Ops are timed with CUDA events there, bf16 ops in bf16 (the
    signature holds every dtype). ``timed`` counts the signatures this instance actually ran.
    """

    def __init__(self, device="cpu", cache_dir=None, *, reps: int = 5,
                 fallback: CostModel | None = None):
        import torch

        self.device = torch.device(device)
        self.reps = max(1, reps)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("MeasuredCost(device='cuda'): CUDA is not available")
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", idx)
            gpu = torch.cuda.get_device_name(idx)
            # fp32 matmuls and convolutions time differently with TF32 on and off:
            # each setting has its own cache, and the fallback roofline follows it
            mm, conv = _tf32()
            tag = f"cuda-{gpu}-tf32mm{int(mm)}conv{int(conv)}"
            self.fallback = fallback or RooflineCost(_profile_for_gpu(gpu), tf32=mm)
        elif self.device.type == "cpu":
            tag = f"cpu-{_cpu_model()}-{torch.get_num_threads()}t"
            self.fallback = fallback or RooflineCost("cpu")
        else:
            raise ValueError(f"MeasuredCost: unsupported device {device!r}")
        self.path = _cache_dir(cache_dir) / f"costs-{_slug(torch.__version__)}-{_slug(tag)}.json"
        data = self._read()
        # the timings of each op (Note [a timing is confirmed once per process]):
        # the file's, then this process's; its price is their median
        self.samples: dict[str, list[float] | None] = {
            k: _samples(v) for k, v in data.get("ops", {}).items()}
        self.table: dict[str, float | None] = {
            k: None if v is None else statistics.median(v) for k, v in self.samples.items()}
        self.fresh: dict[str, float | None] = {}    # this process's timing, not yet saved
        self.unsaved: set[str] = set()     # timed on a busy CPU (Note [timings taken on a busy CPU])
        self.canary_best: float | None = _canary_of(data)
        self._canary_args = None
        self.timed = 0
        self._host_bw: float | None = None
        self._saved_at = -math.inf

    def __repr__(self) -> str:
        return f"MeasuredCost({str(self.device)!r}, {len(self.table)} signatures)"

    @property
    def label(self) -> str:
        return f"measured:{self.device.type}"

    @property
    def async_copies(self) -> bool:
        """Swaps run on a CUDA copy stream (`runtime.copies`); on the CPU they are
        ordinary synchronous copies."""
        return self.cuda

    # -- cache ---------------------------------------------------------------
    def _read(self) -> dict:
        """The cache file's contents ({} when missing or unreadable)."""
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def save(self) -> None:
        """Merge this instance's new timings into the file (atomic replace), leaving
        out those taken on a busy CPU: each op keeps its last `SAMPLES` timings."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        on_disk = self._read()
        merged = dict(on_disk.get("ops", {}))
        for k, t in self.fresh.items():
            if k in self.unsaved:
                continue
            # another process may have added its timings meanwhile: ours after them
            old = _samples(merged.get(k))
            merged[k] = _entry(None if t is None else ((old or []) + [t])[-SAMPLES:])
        best = min(x for x in (_canary_of(on_disk), self.canary_best, float("inf")) if x)
        data = {"ops": dict(sorted(merged.items()))}
        if math.isfinite(best):
            data["canary"] = best
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=0)
        os.replace(tmp, self.path)
        self.fresh.clear()
        self._saved_at = time.perf_counter()
        DIRTY.discard(self)

    # -- a busy CPU ----------------------------------------------------------
    def canary(self) -> float:
        """Seconds of the canary matmul (least of three)."""
        import torch

        if self._canary_args is None:
            g = torch.Generator().manual_seed(0)
            self._canary_args = (torch.randn(CANARY_N, CANARY_N, generator=g),
                                 torch.randn(CANARY_N, CANARY_N, generator=g))
        a, b = self._canary_args
        return min(call_seconds(torch.mm, (a, b)) for _ in range(3))

    def busy(self) -> bool:
        """Whether the canary ran more than BUSY times its best (which it updates)."""
        c = self.canary()
        best = self.canary_best
        self.canary_best = c if best is None else min(best, c)
        return best is not None and c > BUSY * best

    # -- signature -----------------------------------------------------------
    @staticmethod
    def signature(graph: Graph, n: Node) -> str:
        import torch

        def enc(o):
            if isinstance(o, Ref):
                t = graph.tensor(o)
                st = list(t.stride) if t.stride is not None else None
                return ["T", list(t.shape), dtype_name(t.dtype), st]
            if isinstance(o, (list, tuple)):
                return [enc(x) for x in o]
            if isinstance(o, dict):
                return {k: enc(v) for k, v in sorted(o.items())}
            if isinstance(o, torch.device):
                return "<device>"
            if isinstance(o, float) and not math.isfinite(o):
                return repr(o)
            if isinstance(o, (bool, int, float, str)) or o is None:
                return o
            return repr(o)

        # a node the program runs through a substitute (magis_nb.kernels) is timed
        # as that: its own key, so no timing of the ATen op is reused for it
        sub = SUBSTITUTES.get(n.target)
        name = n.target if sub is None else f"{n.target}:{sub[0]}"
        return json.dumps([name, enc(list(n.args)), enc(dict(n.kwargs))], separators=(",", ":"))

    # -- measuring -----------------------------------------------------------
    def _inputs(self, graph: Graph, n: Node):
        import torch

        # made where the op runs: on a GPU, random gigabytes drawn on the CPU and
        # copied over took seconds per op and starved the search (first H200 run:
        # 3 states in 28 s on the "gpu" GPT)
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(0)
        made: dict[Ref, object] = {}

        def make(r: Ref):
            if r in made:
                return made[r]
            t = graph.tensor(r)
            shape = tuple(int(s) for s in t.shape)
            stride = tuple(t.stride) if t.stride is not None and len(t.stride) == len(shape) else None
            if stride is None:
                stride = torch.empty(shape, device="meta").stride()
            if 0 in stride:
                # an expanded view (stride 0) cannot be written element by element:
                # make the small base and expand it, as the program does
                base = tuple(1 if st == 0 else sz for sz, st in zip(shape, stride))
                src = torch.randn(base, generator=gen, device=dev) if t.dtype.is_floating_point \
                    else torch.zeros(base, device=dev)
                made[r] = src.to(t.dtype).expand(shape)
                return made[r]
            x = torch.empty_strided(shape, stride, dtype=t.dtype, device=dev)
            if x.is_floating_point():
                x.copy_(torch.randn(shape, generator=gen, device=dev).to(t.dtype))
            else:
                x.zero_()
            made[r] = x
            return x

        def sub(o):
            if isinstance(o, Ref):
                return make(o)
            if isinstance(o, torch.device):
                return self.device
            if isinstance(o, list):
                return [sub(x) for x in o]
            if isinstance(o, tuple):
                return tuple(sub(x) for x in o)
            if isinstance(o, dict):
                return {k: sub(v) for k, v in o.items()}
            return o

        return sub(tuple(n.args)), sub(dict(n.kwargs))

    def time_op(self, graph: Graph, n: Node) -> float | None:
        """Least seconds of ``reps`` runs after one warm-up; None if it cannot run
        (Note [timings taken on a busy CPU])."""
        import torch

        if not isinstance(n.op, torch._ops.OpOverload):
            return None
        fn = callable_for(n.target, n.op)
        devices = [self.device.index] if self.cuda else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            try:
                args, kwargs = self._inputs(graph, n)
                t0 = time.perf_counter()
                fn(*args, **kwargs)            # warm-up
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                first = time.perf_counter() - t0
                reps = self.reps if first < 0.1 else 1
                ts = [call_seconds(fn, args, kwargs, cuda=self.cuda) for _ in range(reps)]
            except Exception:                  # noqa: BLE001 -- any failure: fall back
                return None
        self.timed += 1
        return min(ts)

    def _timed(self, key: str, graph: Graph, n: Node) -> float | None:
        """``n`` timed into the table; on a CPU found busy, not to be saved."""
        busy = not self.cuda and self.busy()
        t = self.time_op(graph, n)
        if not self.cuda and (self.busy() or busy):
            self.unsaved.add(key)
        else:
            CONFIRMED.add((str(self.path), key))
            self.fresh[key] = t
        self.samples[key] = None if t is None else [t]
        self.table[key] = t
        return t

    def _confirm(self, key: str, graph: Graph, n: Node) -> bool:
        """An op read from the file, timed once more in this process: its price
        becomes the median of its timings. Whether a timing was taken (Note [a
        timing is confirmed once per process])."""
        old = self.samples.get(key)
        if old is None:                        # unrunnable: nothing to confirm
            CONFIRMED.add((str(self.path), key))
            return False
        busy = not self.cuda and self.busy()
        t = self.time_op(graph, n)
        if not self.cuda and (self.busy() or busy):
            return False                       # adds no sample: asked again on the next use
        CONFIRMED.add((str(self.path), key))
        if t is None:
            return False
        got = self.samples[key] = (old + [t])[-SAMPLES:]
        self.table[key] = statistics.median(got)
        self.fresh[key] = t
        return True

    def _known(self, key: str) -> bool:
        return key in self.unsaved or (str(self.path), key) in CONFIRMED

    def measure(self, graph: Graph, nodes: Sequence[int] | None = None) -> int:
        """Time every not-yet-cached op of ``graph``, then save once; returns how many."""
        before = self.timed
        new = False
        for nid in (graph.program_order() if nodes is None else nodes):
            n = graph.nodes[nid]
            key = self.signature(graph, n)
            if key not in self.table:
                self._timed(key, graph, n)
                new = True
            elif not self._known(key):
                new = self._confirm(key, graph, n) or new
        if new:
            self.save()
        return self.timed - before

    def op_cost(self, graph: Graph, node: Node | int) -> float:
        n = node_of(graph, node)
        if n.kind != "op":
            return 0.0
        key = self.signature(graph, n)
        if key not in self.table:
            self._timed(key, graph, n)
            self._dirty()
        elif not self._known(key) and self._confirm(key, graph, n):
            self._dirty()
        t = self.table[key]
        return float(t) if t is not None else self.fallback.op_cost(graph, n)

    def _dirty(self) -> None:
        DIRTY.add(self)
        if time.perf_counter() - self._saved_at >= SAVE_EVERY:
            self.save()

    def transfer_cost(self, nbytes: int) -> float:
        """Host link time: a measured pinned host<->device copy on CUDA; on the CPU a
        swap is a memory copy (read + write)."""
        if nbytes <= 0:
            return 0.0
        if self._host_bw is None:
            self._host_bw = self._measure_host_bw()
        return nbytes / self._host_bw

    def _measure_host_bw(self) -> float:
        if not self.cuda:
            return self.fallback.profile.host_link_bw if isinstance(self.fallback, RooflineCost) \
                else get_profile("cpu").host_link_bw
        import torch
        n = 64 * 2**20
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=self.device)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(self.device)
        ts = [call_seconds(lambda: dev.copy_(host, non_blocking=True), cuda=True) for _ in range(5)]
        return n / statistics.median(ts)
