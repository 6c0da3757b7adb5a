"""Data types and helpers for the per-op dimension rules (see ``dims.py``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ..ir.graph import Node, Ref

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Axis:
    """One iteration axis of an op along which it can be split into equal contiguous parts."""
    size: int                                # n must divide it (see Note [axis sizes])
    inputs: tuple[tuple[int, int], ...]      # (tensor-input index, dim) indexed by this axis
    outputs: tuple[tuple[int, int], ...]     # (output index, dim) indexed by this axis
    combine: str | None = "sum"              # "sum" | "max" | "min" | "mean" | None: how an
                                             # output that lacks the axis merges across parts
    name: str = ""


# A listed dim is an int d, or (d, block) for a dim of length L seen as
# [L / block, block] and split along the inner block: Note [blocked dims].
Dim = "int | tuple[int, int]"


def dim_index(d) -> int:
    """The tensor dim of a listed dim."""
    return d[0] if isinstance(d, tuple) else d


def dim_block(d, length: int) -> int:
    """The block a listed dim is split in (its whole length for a plain dim)."""
    return d[1] if isinstance(d, tuple) else length


# (node, axis index, part output shapes) -> (args, kwargs) of one part
Rewrite = Callable[[Node, int, list], tuple[tuple, dict]]


@dataclass
class OpDims:
    axes: list[Axis]
    rewrite: Rewrite | None = None
    # axes the D-Graph added with blocked dims (Note [blocked dims]) -> the plain
    # axis each repeats: a part's arguments are the same (its shapes are)
    origin: dict[int, int] = field(default_factory=dict)
    # tensor inputs the kernel needs contiguous: a part narrowed along an inner
    # dim is copied first (a view cannot merge it; norms read strides wrong or
    # copy it themselves, which the memory model would not see)
    contiguous: frozenset = frozenset()

    def chunk_args(self, node: Node, axis: int, out_shapes: list) -> tuple[tuple, dict]:
        """The op's (args, kwargs) for one part when split along ``axis``.

        ``out_shapes[i]`` is the shape of the part's output i: the full shape with
        every dim listed in ``axes[axis].outputs`` divided by n (None where the op
        has no tensor output i). Shape-carrying arguments (view sizes, factory
        sizes, bias_sizes, groups ...) are rewritten for the part; Refs stay.
        """
        if self.rewrite is None:
            return tuple(node.args), dict(node.kwargs)
        return self.rewrite(node, self.origin.get(axis, axis), out_shapes)


class Bound:
    """A node's arguments by schema name, with the tensor-input index of each Ref.

    Tensor-input index k = position in ``node.refs()``.
    """

    def __init__(self, node: Node):
        self.node = node
        schema = node.op._schema
        self.names = [a.name for a in schema.arguments]
        self.vals: dict = {}
        self.tix: dict = {}          # name -> int, or list[int | None] for lists
        k = 0

        def count(v):
            nonlocal k
            if isinstance(v, Ref):
                k += 1
                return k - 1
            if isinstance(v, (list, tuple)):
                return [count(x) for x in v]
            return None

        for name, v in zip(self.names, node.args):
            self.vals[name] = v
            self.tix[name] = count(v)
        for name, v in node.kwargs.items():
            self.vals[name] = v
            self.tix[name] = count(v)
        for a in schema.arguments:
            if a.name not in self.vals and a.has_default_value():
                self.vals[a.name] = a.default_value

    def __getitem__(self, name):
        return self.vals.get(name)

    def t(self, name) -> int | None:
        """Tensor-input index of argument ``name`` (None: absent or not a tensor)."""
        i = self.tix.get(name)
        return i if isinstance(i, int) else None

    def replace(self, **new) -> tuple[tuple, dict]:
        args, kwargs = list(self.node.args), dict(self.node.kwargs)
        for name, v in new.items():
            i = self.names.index(name)
            if i < len(args):
                args[i] = v
            else:
                kwargs[name] = v
        return tuple(args), kwargs


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def ax(size, inputs, outputs, combine="sum", name="") -> Axis | None:
    """An Axis, or None when it cannot be split (size < 2)."""
    if size is None or size < 2:
        return None
    return Axis(int(size), tuple(inputs), tuple(outputs), combine, name)


def axes_of(*items) -> list[Axis]:
    return [a for a in items if a is not None]


def parts(node: Node, axis: Axis, out_shapes: list) -> int:
    """n, read off a part output shape of a listed output dim."""
    for i, d in axis.outputs:
        d = dim_index(d)
        full = node.outputs[i].shape if node.outputs[i] is not None else None
        part = out_shapes[i] if i < len(out_shapes) else None
        if full is not None and part is not None and part[d]:
            return full[d] // part[d]
    raise ValueError(f"{node.target}: cannot tell the number of parts from {out_shapes}")


def broadcast_axes(in_shapes: list[Shape], tensor_ix: list[int], out_shape: Shape,
                   outputs: list[int], combine="sum") -> list[Axis]:
    """Elementwise axes: each output dim, aligned from the right with the inputs
    in ``tensor_ix`` that have the same size there (size-1 broadcasts are not indexed)."""
    r = len(out_shape)
    res = []
    for d, size in enumerate(out_shape):
        ins = []
        for j in tensor_ix:
            s = in_shapes[j]
            dj = d - (r - len(s))
            if dj >= 0 and s[dj] == size:
                ins.append((j, dj))
        a = ax(size, ins, [(o, d) for o in outputs], combine)
        if a is not None:
            res.append(a)
    return res


def gcd(a: int, b: int) -> int:
    return math.gcd(a, b)


# target ("aten.mm.default") -> rule(node, bound, in_shapes, out_shapes) -> OpDims | None
RULES: dict[str, Callable] = {}


def rule(*targets: str):
    """Register ``fn`` as the rule of ``targets``. A target has one rule: a
    second registration raises, so which rule holds never depends on the order
    modules are imported in."""
    def deco(fn):
        for t in targets:
            key = t if t.count(".") >= 2 else t + ".default"
            old = RULES.get(key)
            if old is not None and old is not fn:
                raise ValueError(f"{key} already has a dimension rule ({old.__module__}."
                                 f"{old.__qualname__}); {fn.__module__}.{fn.__qualname__} "
                                 "would replace it: merge the two")
            RULES[key] = fn
        return fn
    return deco
