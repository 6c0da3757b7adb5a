"""Seeded random irregular training graphs (NASNet-like and randwire-like).

A graph is built the way a framework emits it: the forward ops in definition order
(cell by cell, branch by branch), then the backward ops in reverse creation order
(what PyTorch's autograd engine does), gradient contributions accumulated eagerly
by pairwise adds. Weights and the input batch are resident storages; weight
gradients are kept outputs; backward ops read the forward activations they save.
The op index order is that program order.

``random_mutation`` lives in mutations.py and is re-exported here.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from magis_nb.simulate.memory import MemGraph, Storage

MiB = 1 << 20


@dataclass
class _Builder:
    names: list[str] = field(default_factory=list)
    preds: list[list[int]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)        # per storage
    producer: list[int] = field(default_factory=list)
    users: list[list[int]] = field(default_factory=list)
    keep: list[bool] = field(default_factory=list)
    cat: list[str] = field(default_factory=list)

    def resident(self, size: int, category: str = "weight") -> int:
        return self._storage(size, -1, False, category)

    def _storage(self, size, producer, keep, category) -> int:
        self.sizes.append(int(size))
        self.producer.append(producer)
        self.users.append([])
        self.keep.append(keep)
        self.cat.append(category)
        return len(self.sizes) - 1

    def op(self, name: str, inputs: list[int], size: int, *, keep: bool = False,
           category: str = "activation") -> int:
        """Add an op reading ``inputs`` and producing one storage; return it."""
        v = len(self.names)
        self.names.append(name)
        ps = []
        for s in dict.fromkeys(inputs):
            self.users[s].append(v)
            p = self.producer[s]
            if p >= 0 and p not in ps:
                ps.append(p)
        self.preds.append(ps)
        return self._storage(size, v, keep, category)

    def build(self) -> MemGraph:
        st = [Storage(self.sizes[i], self.producer[i], tuple(self.users[i]),
                      self.keep[i], self.cat[i]) for i in range(len(self.sizes))]
        return MemGraph(len(self.names), [list(p) for p in self.preds], st,
                        list(self.names))


@dataclass
class _Fwd:
    name: str
    inputs: list[int]          # activation storages
    weight: int | None         # resident storage
    out: int
    saves: list[int]           # storages the backward op reads


def _backward(b: _Builder, fwd: list[_Fwd], loss_grad_of: int, gsize: int) -> None:
    grads: dict[int, int] = {loss_grad_of: b.op("loss.seed", [loss_grad_of], gsize,
                                                category="gradient")}
    for f in reversed(fwd):
        g = grads.pop(f.out, None)
        if g is None:
            continue
        if f.weight is not None:
            b.op(f"{f.name}.wgrad", [g] + f.saves, b.sizes[f.weight], keep=True,
                 category="gradient")
        for k, x in enumerate(f.inputs):
            if b.producer[x] < 0:
                continue           # the input batch needs no gradient
            gx = b.op(f"{f.name}.bwd{k}", [g] + f.saves, b.sizes[x],
                      category="gradient")
            if x in grads:         # eager accumulation, as autograd does
                gx = b.op(f"{f.name}.acc{k}", [grads[x], gx], b.sizes[x],
                          category="gradient")
            grads[x] = gx


def _unary(rng, b, fwd, name, x, size):
    """A conv/pool/relu-like op; convs save their input, relus their output."""
    kind = rng.choice(["conv", "conv", "sep", "pool", "relu"])
    w = b.resident(max(size // 64, 64 << 10)) if kind in ("conv", "sep") else None
    ins = [x] + ([w] if w is not None else [])
    out = b.op(f"{name}.{kind}", ins, size)
    saves = {"conv": [x, w], "sep": [x, w], "pool": [x, out], "relu": [out]}[kind]
    fwd.append(_Fwd(f"{name}.{kind}", [x], w, out, saves))
    return out


def random_nasnet(seed: int, cells: int = 8, blocks: int = 5,
                  base: int = 4 * MiB, train: bool = True) -> MemGraph:
    """NASNet-like: cells of ``blocks`` two-branch blocks reading the two previous
    cells and earlier blocks; every third cell a reduction (tensors halve)."""
    rng = random.Random(seed)
    b, fwd = _Builder(), []
    x = b.resident(base, "input")
    size = base
    h1 = _unary(rng, b, fwd, "stem", x, size)
    h0 = h1
    for c in range(cells):
        if c % 3 == 2:
            size = max(size // 2, MiB)
        avail = [h0, h1]
        outs = []
        for k in range(blocks):
            branch = []
            for side in range(2):
                t = rng.choice(avail)
                for d in range(rng.randint(1, 3)):
                    sz = max(int(size * rng.choice([0.5, 1, 1, 1.5, 2])) // MiB, 1) * MiB
                    t = _unary(rng, b, fwd, f"c{c}.b{k}.{side}.{d}", t, sz)
                branch.append(t)
            s = b.op(f"c{c}.b{k}.add", branch, size)
            fwd.append(_Fwd(f"c{c}.b{k}.add", branch, None, s, []))
            avail.append(s)
            outs.append(s)
        cat = b.op(f"c{c}.concat", outs, size * len(outs) // 2)
        fwd.append(_Fwd(f"c{c}.concat", outs, None, cat, []))
        h0, h1 = h1, _unary(rng, b, fwd, f"c{c}.proj", cat, size)
    return _finish(b, fwd, h1, train)


def random_randwire(seed: int, stages: int = 3, nodes: int = 12, k: int = 3,
                    base: int = 4 * MiB, train: bool = True) -> MemGraph:
    """Randwire-like: per stage a random DAG where each node sums 1-``k`` earlier
    nodes (mostly recent ones) and applies a conv; stage output = sum of sinks."""
    rng = random.Random(seed)
    b, fwd = _Builder(), []
    x = b.resident(base, "input")
    size = base
    h = _unary(rng, b, fwd, "stem", x, size)
    for st in range(stages):
        outs = []
        used = set()
        for i in range(nodes):
            if i == 0:
                srcs = [h]
            else:
                lo = max(0, i - 2 * k)
                idx = sorted(rng.sample(range(lo, i), min(i - lo, rng.randint(1, k))))
                srcs = [outs[j] for j in idx]
                used.update(idx)
            t = srcs[0]
            if len(srcs) > 1:
                t = b.op(f"s{st}.n{i}.sum", srcs, size)
                fwd.append(_Fwd(f"s{st}.n{i}.sum", srcs, None, t, []))
            t = _unary(rng, b, fwd, f"s{st}.n{i}.a", t, size)
            t = _unary(rng, b, fwd, f"s{st}.n{i}.b", t,
                       max(int(size * rng.choice([0.5, 1, 2])) // MiB, 1) * MiB)
            outs.append(t)
        sinks = [outs[i] for i in range(nodes) if i not in used]
        size = max(size // 2, MiB)
        h = b.op(f"s{st}.out", sinks, size)
        fwd.append(_Fwd(f"s{st}.out", sinks, None, h, []))
    return _finish(b, fwd, h, train)


def transformer_like(layers: int = 48, base: int = 4 * MiB,
                     train: bool = True) -> MemGraph:
    """A chain of BERT-like layers (q/k/v branches, attention, MLP, residuals):
    mostly chain-like with narrow waists, for scale tests (48 layers ~ 3500 ops)."""
    b, fwd = _Builder(), []

    def op(name, ins, size, w=None, saves=()):
        out = b.op(name, ins + ([w] if w is not None else []), size)
        fwd.append(_Fwd(name, ins, w, out, list(saves) + ([w] if w is not None else [])))
        return out
    x = b.resident(base, "input")
    h = op("embed", [x], base, b.resident(8 * MiB), [x])
    for i in range(layers):
        p = f"l{i}"
        ln = op(f"{p}.ln1", [h], base, b.resident(64 << 10), [h])
        qkv = [op(f"{p}.{t}", [ln], base, b.resident(MiB), [ln]) for t in "qkv"]
        sc = op(f"{p}.scores", qkv[:2], 2 * base, None, qkv[:2])
        pr = op(f"{p}.softmax", [sc], 2 * base, None, [])
        pr2 = op(f"{p}.softmax.out", [pr], 2 * base, None, [pr])
        ctx = op(f"{p}.ctx", [pr2, qkv[2]], base, None, [pr2, qkv[2]])
        h = op(f"{p}.res1", [h, op(f"{p}.proj", [ctx], base, b.resident(MiB), [ctx])],
               base)
        ln2 = op(f"{p}.ln2", [h], base, b.resident(64 << 10), [h])
        up = op(f"{p}.fc1", [ln2], 4 * base, b.resident(4 * MiB), [ln2])
        act = op(f"{p}.gelu", [up], 4 * base, None, [up])
        h = op(f"{p}.res2", [h, op(f"{p}.fc2", [act], base, b.resident(4 * MiB),
                                   [act])], base)
    return _finish(b, fwd, h, train)


def _finish(b: _Builder, fwd: list[_Fwd], h: int, train: bool) -> MemGraph:
    """Training: a scalar loss and the backward. Inference: ``h`` is the output."""
    if not train:
        b.keep[h] = True
        return b.build()
    loss = b.op("loss", [h], 4, keep=True, category="loss")
    fwd.append(_Fwd("loss", [h], None, loss, [h]))
    _backward(b, fwd, loss, 4)
    return b.build()


def random_graph(seed: int, kind: str | None = None, train: bool = True) -> MemGraph:
    """A NASNet-like graph for even seeds, randwire-like for odd ones (or ``kind``)."""
    kind = kind or ("nasnet" if seed % 2 == 0 else "randwire")
    f = random_nasnet if kind == "nasnet" else random_randwire
    return f(seed, train=train)


from .mutations import random_mutation  # noqa: E402  (re-export)

__all__ = ["random_nasnet", "random_randwire", "random_graph", "transformer_like",
           "random_mutation", "MiB"]
