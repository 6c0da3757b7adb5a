"""A Weisfeiler-Lehman style structural digest of a Graph.

Two graphs get the same digest when they have the same ops with the same shapes and
constant arguments wired the same way, whatever the node names and ids. The search
uses it to skip states it has already explored (Algorithm 3's GraphHash).
"""
from __future__ import annotations

import hashlib

from .graph import Graph, Ref


def _h(*parts) -> bytes:
    m = hashlib.blake2b(digest_size=16)
    for p in parts:
        m.update(p if isinstance(p, bytes) else repr(p).encode())
        m.update(b"\x00")
    return m.digest()


def _const(obj, label):
    """Constant arguments with tensor refs replaced by their nodes' labels."""
    if isinstance(obj, Ref):
        return ("ref", label[obj.node].hex(), obj.out)
    if isinstance(obj, (list, tuple)):
        return tuple(_const(o, label) for o in obj)
    if isinstance(obj, dict):
        return tuple(sorted((k, _const(v, label)) for k, v in obj.items()))
    return repr(obj)


def node_labels(g: Graph) -> list[bytes]:
    """x_v = hash(op, outputs, args with the predecessors' labels in argument order)."""
    label: list[bytes] = [b""] * len(g.nodes)
    for n in g.nodes:  # ids are a topological order
        outs = tuple((t.shape, str(t.dtype), t.alias is not None) if t else None
                     for t in n.outputs)
        role = n.role[0] if n.role else ""
        label[n.id] = _h(n.kind, n.target, role, outs, _const((n.args, n.kwargs), label))
    return label


def graph_digest(g: Graph) -> str:
    label = node_labels(g)
    outs = [(label[r.node].hex(), r.out) for r in g.outputs]
    return _h(sorted(label), outs).hex()
