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

from ..ir.graph import Graph, Ref, iter_refs

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


def generate(g: Graph, order: Sequence[int], fn_name: str = "step") -> str:
    """Python source of ``def step(_dev, *inputs) -> tuple(outputs)``."""
    pos = {nid: i for i, nid in enumerate(order)}
    if sorted(pos) != sorted(n.id for n in g.ops):
        raise ValueError("the schedule must contain every op exactly once")
    returned = set(g.outputs)
    last: dict[Ref, int] = {}
    for nid in order:
        for r in iter_refs((g.nodes[nid].args, g.nodes[nid].kwargs)):
            last[r] = max(last.get(r, -1), pos[nid])
    dels: dict[int, list[str]] = {}
    for r, p in last.items():
        if r not in returned and g.nodes[r.node].kind == "op":
            dels.setdefault(p, []).append(_var(g, r))

    params = ", ".join(["_dev"] + [n.name for n in g.inputs])
    lines = [f"def {fn_name}({params}):"]
    for i, nid in enumerate(order):
        n = g.nodes[nid]
        outs = [Ref(nid, k) for k in range(len(n.outputs))]
        lhs = ", ".join(_var(g, r) for r in outs)
        if len(outs) == 1 and n.multi:
            lhs += ","
        lines.append(f"    {lhs} = {_call(g, nid)}  # {_shape_note(g, nid)}")
        # Outputs nobody reads are dropped at once (e.g. the unused parts of a
        # multi-output op), as the simulator assumes.
        dead = [_var(g, r) for r in outs if r not in last and r not in returned]
        gone = sorted(set(dels.get(i, []) + dead))
        if gone:
            lines.append(f"    del {', '.join(gone)}")
    ret = ", ".join(_var(g, r) for r in g.outputs)
    lines.append(f"    return ({ret},)" if len(g.outputs) == 1 else f"    return ({ret})")
    return "\n".join(lines) + "\n"


def compile_source(src: str, fn_name: str = "step"):
    """Compile generated source; tracebacks through it show the generated lines."""
    filename = f"<magis_nb-generated-{next(_counter)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = {"torch": torch, "aten": torch.ops.aten}
    exec(compile(src, filename, "exec"), ns)
    return ns[fn_name]
