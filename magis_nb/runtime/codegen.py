"""IR + schedule -> readable Python source that runs the program with PyTorch ops.

Ops run in schedule order and every variable is deleted right after its last use,
so the storages live exactly as long as the memory simulator says (a storage dies
when the last variable holding it, or a view of it, is deleted).
"""
from __future__ import annotations

import itertools
import linecache
import math
from typing import Sequence

import torch

from ..analysis.causal import CAUSAL_MASK_TARGET
from ..distributed.buckets import BUCKET_TARGET
from ..ir.graph import Graph, LossSeed, Ref, Region
from ..kernels import SUBSTITUTES, namespace
from ..rules.swap import swap_ops
from ..simulate.cost import is_free
from .copies import SYNC

_counter = itertools.count()


def _var(g: Graph, r: Ref) -> str:
    n = g.nodes[r.node]
    return f"{n.name}_{r.out}" if n.multi else n.name


def _render(g: Graph, obj) -> str:
    if isinstance(obj, Ref):
        return _var(g, obj)
    if isinstance(obj, (list, tuple)):
        inner = ", ".join(_render(g, o) for o in obj)
        if isinstance(obj, tuple):
            return f"({inner},)" if len(obj) == 1 else f"({inner})"
        return f"[{inner}]"
    if isinstance(obj, LossSeed):
        return "_seed"
    if isinstance(obj, float):
        if math.isinf(obj) or math.isnan(obj):
            return f"float('{obj}')"
        return repr(obj)
    if isinstance(obj, (bool, int, str)) or obj is None:
        return repr(obj)
    if isinstance(obj, torch.device):
        return "_dev"  # the graph runs on the device of its inputs
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return repr(obj)
    raise NotImplementedError(f"cannot render argument {obj!r} ({type(obj).__name__})")


def _call(g: Graph, nid: int) -> str:
    n = g.nodes[nid]
    if not isinstance(n.op, torch._ops.OpOverload):
        raise NotImplementedError(f"op {n.target} is not an ATen operator")
    ns, rest = n.target.split(".", 1)
    fn = f"{ns}.{rest}" if ns == "aten" else f"torch.ops.{n.target}"
    if n.target in SUBSTITUTES:
        fn = SUBSTITUTES[n.target][0]   # the same result, faster (magis_nb.kernels)
    parts = [_render(g, a) for a in n.args]
    parts += [f"{k}={_render(g, v)}" for k, v in n.kwargs.items()]
    return f"{fn}({', '.join(parts)})"


def _shape_note(g: Graph, nid: int) -> str:
    n = g.nodes[nid]
    outs = []
    for t in n.outputs:
        if t is None:
            continue
        dt = str(t.dtype).replace("torch.", "")
        outs.append(f"{dt}{list(t.shape)}" + ("" if t.alias is None else " view"))
    return ", ".join(outs)


def _lastuse(g: Graph, order: Sequence[int]) -> tuple[dict[int, list[Ref]], set[Ref]]:
    """Refs to delete after each position (their last use), as the simulator frees."""
    pos = {nid: i for i, nid in enumerate(order)}
    returned = set(g.outputs)
    last: dict[Ref, int] = {}
    for nid in order:
        for r in g.nodes[nid].refs():
            last[r] = max(last.get(r, -1), pos[nid])
    dels: dict[int, list[Ref]] = {}
    for r, p in last.items():
        if r not in returned and g.nodes[r.node].kind == "op":
            dels.setdefault(p, []).append(r)
    for i, nid in enumerate(order):
        # Outputs nobody reads are dropped at once (e.g. the unused parts of a
        # multi-output op), as the simulator assumes.
        for k in range(len(g.nodes[nid].outputs)):
            r = Ref(nid, k)
            if r not in last and r not in returned:
                dels.setdefault(i, []).append(r)
    return dels, returned


class _Swaps:
    """Where a program's swaps put their `copies` calls (see runtime.copies).

    A Store is issued right after its tensor's producer (as the latency model
    places it); its own line (``stored``) is where the program waits for the
    copy, and the tensor may be deleted after it (Note [a Store's free point]
    in runtime/copies.py). A Load's line issues the copy back; the compute stream
    waits for it (``ready``) just before the first op that reads the copy.
    """

    def __init__(self, g: Graph, order: Sequence[int]):
        stores, loads = swap_ops(g)
        self.any = bool(stores)
        self.store_k = {s: k for k, s in enumerate(stores)}
        self.load_k = {ld: j for j, ld in enumerate(loads)}
        self.after: dict[int, list[int]] = {}           # producer -> its Stores
        for s in stores:
            self.after.setdefault(g.nodes[s].args[1].node, []).append(s)
        pos = {v: i for i, v in enumerate(order)}
        # Load -> position of its first reader that touches its data: views of
        # the loaded copy do not, and wait for nothing (as `search.transfers_of`
        # prices it: the two agree op for op, tests/test_cuda_protocol.py)
        readers: dict[int, int] = {}
        for v in order:
            if is_free(g.nodes[v]):
                continue
            for r in g.nodes[v].refs():
                ld = g.storage_of(r).node
                if ld in self.load_k and ld not in readers:
                    readers[ld] = pos[v]
        self.ready_at: dict[int, list[int]] = {}
        for ld, p in readers.items():
            self.ready_at.setdefault(p, []).append(self.load_k[ld])
        # a Load no op reads the data of may be freed soon after its line: the
        # compute stream waits for its copy right there, or the block goes back
        # to the pool while the copy stream still writes it
        self.unread = {ld: k for ld, k in self.load_k.items() if ld not in readers}

    def call(self, g: Graph, nid: int) -> str | None:
        n = g.nodes[nid]
        if nid in self.store_k:
            pool, x = n.args
            return (f"_io.stored({self.store_k[nid]}, {_var(g, pool)})  # Store of {_var(g, x)} "
                    "done: it may be freed from here")
        if nid in self.load_k:
            return f"_io.load({self.load_k[nid]}, {_var(g, n.args[0])}, _dev)  # {_shape_note(g, nid)}"
        return None

    def stores_after(self, g: Graph, nid: int) -> list[str]:
        out = []
        for s in self.after.get(nid, ()):
            pool, x = g.nodes[s].args
            out.append(f"_io.store({self.store_k[s]}, {_var(g, pool)}, {_var(g, x)})")
        return out

    def settle(self, nid: int) -> list[str]:
        """After ``nid``'s line: wait for it if it is a Load nobody reads."""
        return [f"_io.ready({self.unread[nid]})"] if nid in self.unread else []

    def ready(self, first: int, stop: int) -> list[str]:
        ks = sorted(k for p in range(first, stop) for k in self.ready_at.get(p, ()))
        return [f"_io.ready({k})" for k in ks]


def _line(g: Graph, nid: int, loop_var: bool = False, swaps: _Swaps | None = None) -> str:
    n = g.nodes[nid]
    outs = [Ref(nid, k) for k in range(len(n.outputs))]
    lhs = ", ".join(_var(g, r) for r in outs)
    if len(outs) == 1 and n.multi:
        lhs += ","
    special = swaps.call(g, nid) if swaps is not None else None
    if special is not None:
        return f"{lhs} = {special}"
    if n.target == BUCKET_TARGET:       # its all_reduce is issued here (distributed/buckets.py)
        k = bucket_nodes(g).index(nid)
        return f"{lhs} = _comm.bucket({k}, {_render(g, n.args[0])})  # {_shape_note(g, nid)}"
    call = _call(g, nid)
    at = _part_offsets(n)
    if loop_var and at:
        # part k of a fission loop reads its slice (or its mask rows) at k * chunk
        args = [_render(g, a) for a in n.args]
        for i, expr in at.items():
            args[i] = expr
        call = f"{call.split('(', 1)[0]}({', '.join(args)})"
    if not outs:
        return call
    return f"{lhs} = {call}  # {_shape_note(g, nid)}"


# ops whose argument at this position is part k's offset, k * Region.chunk: a
# fission part's narrow, and its causal mask (analysis/causal.py)
_OFFSET_ARG = {"aten.narrow.default": 2, CAUSAL_MASK_TARGET: 1}
# and whose argument at this position is a length (k + 1) * chunk with
# `Region.prefix`: the keys a causal query part sees (Note [the keys a causal
# part sees] in analysis/causal.py)
_PREFIX_ARG = {"aten.narrow.default": 3, CAUSAL_MASK_TARGET: 2}


def _part_offsets(n) -> dict[int, str]:
    """The arguments of ``n`` that depend on the part, as loop expressions."""
    reg = n.region
    if not isinstance(reg, Region) or not reg.chunk or n.target not in _OFFSET_ARG:
        return {}
    if not reg.prefix:
        return {_OFFSET_ARG[n.target]: f"_k * {reg.chunk}"}
    out = {_PREFIX_ARG[n.target]: f"(_k + 1) * {reg.chunk}"}
    if n.target == CAUSAL_MASK_TARGET:
        out[_OFFSET_ARG[n.target]] = f"_k * {reg.chunk}"
    return out


def _loop_at(g: Graph, order: Sequence[int], i: int, sizes: dict[int, int]):
    """(parts, part length) when order[i:] starts a fission region whose parts are
    contiguous and identical op for op, so it can be emitted as a loop."""
    reg = g.nodes[order[i]].region
    if not isinstance(reg, Region) or reg.part != 0:
        return None
    rid, n = reg.rid, reg.parts
    total = sizes[rid]
    if total % n or i + total > len(order):
        return None
    L = total // n
    run = order[i:i + total]
    sig0 = None
    for k in range(n):
        part = run[k * L:(k + 1) * L]
        if any(g.nodes[v].region[:2] != (rid, k) for v in part):
            return None
        sig = _part_signature(g, part)
        if sig0 is None:
            sig0 = sig
        elif sig != sig0:
            return None
    return n, L


def _part_signature(g: Graph, part: Sequence[int]) -> list:
    """What a part computes, with its own tensors by position and slice offsets
    left out: two parts with equal signatures run the same loop body."""
    where = {v: t for t, v in enumerate(part)}

    def norm(obj):
        if isinstance(obj, Ref):
            return ("part", where[obj.node], obj.out) if obj.node in where else ("ext", obj)
        if isinstance(obj, (list, tuple)):
            return tuple(norm(o) for o in obj)
        if isinstance(obj, dict):
            return tuple(sorted((k, norm(v)) for k, v in obj.items()))
        return repr(obj)

    sig = []
    for v in part:
        n = g.nodes[v]
        args = list(n.args)
        for at in _part_offsets(n):
            args[at] = None
        sig.append((n.target, norm(tuple(args)), norm(n.kwargs)))
    return sig


def bucket_nodes(g: Graph) -> list[int]:
    """The gradient bucket ops: their program takes ``_comm``."""
    return [n.id for n in g.ops if n.target == BUCKET_TARGET]


def seeded(g: Graph) -> bool:
    """Whether the program's backward seed is an argument: it takes ``_seed``."""
    return any(isinstance(a, LossSeed) for n in g.ops for a in n.args)


def generate(g: Graph, order: Sequence[int], fn_name: str = "step") -> str:
    """Python source of ``def step(_dev, *inputs) -> tuple(outputs)``.

    A fission region whose parts are contiguous in ``order`` becomes a loop over
    its parts; its memory behaviour is exactly that of the unrolled program (a
    variable from outside the loop is deleted in the last iteration, where the
    unrolled program would delete it).

    A training program takes a keyword ``_seed``, the backward's seed (see
    `ir.graph.LossSeed`); one with gradient buckets a keyword ``_comm`` (see
    `distributed.buckets`). A program with swaps takes a keyword ``_io`` (see
    `runtime.copies`): the same source runs with synchronous copies (the default)
    or with asynchronous ones on a CUDA copy stream.
    """
    if sorted(order) != sorted(n.id for n in g.ops):
        raise ValueError("the schedule must contain every op exactly once")
    dels, _ = _lastuse(g, order)
    sizes: dict[int, int] = {}
    for n in g.ops:
        if isinstance(n.region, Region):
            sizes[n.region.rid] = sizes.get(n.region.rid, 0) + 1
    swaps = _Swaps(g, order)
    buckets = bool(bucket_nodes(g))
    kw = (["_io=_SYNC"] if swaps.any else []) + (["_seed=1.0"] if seeded(g) else []) \
        + (["_comm"] if buckets else [])
    params = ", ".join(["_dev"] + [n.name for n in g.inputs] + (["*"] + kw if kw else []))
    lines = [f"def {fn_name}({params}):"]
    i = 0
    while i < len(order):
        loop = _loop_at(g, order, i, sizes)
        span = 1 if loop is None else loop[0] * loop[1]
        lines += ["    " + c for c in swaps.ready(i, i + span)]
        if loop is None:
            lines.append("    " + _line(g, order[i], swaps=swaps))
            lines += ["    " + c for c in swaps.stores_after(g, order[i])]
            lines += ["    " + c for c in swaps.settle(order[i])]
            gone = sorted({_var(g, r) for r in dels.get(i, [])})
            if gone:
                lines.append(f"    del {', '.join(gone)}")
            i += 1
            continue
        n, L = loop
        lastpart = {order[i + (n - 1) * L + t]: order[i + t] for t in range(L)}
        lines.append(f"    # fission region {g.nodes[order[i]].region.rid}: {L} ops, {n} parts")
        lines.append(f"    for _k in range({n}):")
        for t in range(L):
            if swaps.after.get(order[i + t]) or swaps.call(g, order[i + t]) is not None:
                raise NotImplementedError("a swap inside a fission loop")  # swap refuses region ops
            lines.append("        " + _line(g, order[i + t], loop_var=True))
            now, later = set(), set()
            for r in dels.get(i + (n - 1) * L + t, []):
                if r.node in lastpart:
                    now.add(_var(g, Ref(lastpart[r.node], r.out)))
                else:
                    later.add(_var(g, r))
            if now:
                lines.append(f"        del {', '.join(sorted(now))}")
            if later:
                lines.append(f"        if _k == {n - 1}:")
                lines.append(f"            del {', '.join(sorted(later))}")
        i += n * L
    if swaps.any:
        lines.append("    _io.finish()")
    if buckets:
        lines.append("    _comm.finish()  # every bucket's all_reduce done, averaged")
    ret = ", ".join(_var(g, r) for r in g.outputs)
    lines.append(f"    return ({ret},)" if len(g.outputs) == 1 else f"    return ({ret})")
    return "\n".join(lines) + "\n"


def compile_source(src: str, fn_name: str = "step"):
    """Compile generated source; tracebacks through it show the generated lines."""
    filename = f"<magis_nb-generated-{next(_counter)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = {"torch": torch, "aten": torch.ops.aten, "_SYNC": SYNC, **namespace()}
    exec(compile(src, filename, "exec"), ns)
    return ns[fn_name]
