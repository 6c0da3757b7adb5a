"""A search state that recomputes what the user's own checkpointing recomputes.

Note [the user's checkpointing as a start state]
A user who ran blocks under ``torch.utils.checkpoint`` (or HF's
``gradient_checkpointing_enable()``) has an eager step that keeps only each
block's inputs; the capture inlines the checkpoints (Note [the user's
checkpoint regions] in capture/checkpoint.py), and the search starting from
the inlined program may never get back as low (corpus Llama with gradient
checkpointing: 6.27 MiB captured, 3.61 MiB eager). `user_checkpoint_state`
re-derives the user's plan as remat batches the search knows: every forward
op of a region whose output the backward reads is recomputed for those
readers, and so is every op of the region that such a recompute reads, each
once, its copy reading the copies of the ops before it (the region's inputs
and weights are read as they are, alive anyway). A batch's copies read the
originals of the tensors they read (`rules.remat.rematerialize_all`), so the
region is recomputed in one batch per level, from its last ops up: the batch
of level h names as users, beside the backward's readers, the copies that the
batches before it made (``{op}_re``). Not recomputed: what draws random
numbers (a dropout's mask, which eager's checkpoint draws again from the RNG
state it saved; the plan keeps the mask, a byte an element), ops that cannot
be recomputed (`can_rematerialize`), and a region's outputs that forward ops
outside it read (the next block's input, which eager keeps too, as that
checkpoint's input). The backward's readers are the ops after the loss and
the ops the capture tagged as a region's backward: a decomposed
``silu_backward``'s ``sigmoid`` reads forward tensors only and is an
activation by category; read as a forward op, it kept the recompute's input
saved (corpus Llama with gradient checkpointing: 4.26 MiB against eager's
3.61; 3.50 with it). The state is an ordinary state of the space: its
``batches`` rebuild it with `Space.build` on any fission plan, and its
children are proposed like any other's.
"""
from __future__ import annotations

import re

from ..ir.graph import Graph, Ref
from ..rules.remat import can_rematerialize
from .space import Batch, Remat, Space, State


def _tagged(g: Graph, tags: dict[str, int]) -> dict[str, int]:
    """Op name in ``g`` -> its region in ``tags`` (names in the captured
    graph): a name the capture tagged, or one a pass made from a tagged name
    (``native_dropout_mask``: the tagged name, ``_`` and a part that does not
    start with a digit, which would be another fx node's own name)."""
    out = {}
    for n in g.ops:
        r = tags.get(n.name)
        if r is None:
            parts = n.name.split("_")
            for k in range(len(parts) - 1, 0, -1):
                head, rest = "_".join(parts[:k]), parts[k]
                if head in tags and rest and not rest[0].isdigit():
                    r = tags[head]
                    break
        if r is not None:
            out[n.name] = r
    return out


def regions_of(space: Space) -> tuple[dict[str, int], set[str]]:
    """(forward op name in ``space.base`` -> the user's checkpoint region it
    ran in, names of the ops of those regions' backward). A backward op that
    reads forward tensors only (``silu_backward`` decomposed: ``sigmoid`` of
    the saved input) is categorized an activation, as the loss does not reach
    it; the capture's tags say it is the backward's."""
    cap = space.program.captured
    tags = getattr(cap, "checkpoint", None) or {}
    if not tags:
        return {}, set()
    bwd = set(_tagged(space.base, getattr(cap, "checkpoint_backward", None) or {}))
    cat = {n.name: n.category for n in space.base.nodes}
    fwd = {nm: r for nm, r in _tagged(space.base, tags).items()
           if nm not in bwd and cat[nm] == "activation"}
    return fwd, bwd


def _ids(g: Graph) -> dict[str, int]:
    return {n.name: n.id for n in g.nodes}


def _allocating(g: Graph, v: int) -> list[Ref]:
    return [Ref(v, i) for i, t in enumerate(g.nodes[v].outputs)
            if t is not None and t.alias is None]


def _copy_name(g: Graph, new: set[str], op: str) -> str | None:
    """The name of ``op``'s recomputed copy among the ``new`` names of ``g``."""
    pat = re.compile(re.escape(op + "_re") + r"(_\d+)?")
    got = sorted(nm for nm in new if pat.fullmatch(nm))
    return got[0] if got else None


def user_checkpoint_state(space: Space, root: State) -> State | None:
    """``root`` with the user's checkpoint regions recomputed as eager's
    checkpoint recomputes them (Note [the user's checkpointing as a start
    state]), evaluated; None when the program has no such region, or none of
    its ops is recomputed."""
    region, backward = regions_of(space)
    if not region:
        return None
    g = g0 = root.graph
    ids = _ids(g)
    rd = g.readers()
    where = {ids[nm]: r for nm, r in region.items() if nm in ids}
    late = {n.id for n in g.ops if n.category == "gradient" or n.name in backward}
    fwd = {n.id for n in g.ops if n.category == "activation" and n.id not in late}
    # the ops that may be recomputed, and each one's readers among them
    cand: dict[int, set[int]] = {}
    for v, r in sorted(where.items()):
        outs = _allocating(g, v)
        if not outs or can_rematerialize(g, v) is not None:
            continue
        readers = set().union(*(rd.get(o, set()) for o in outs))
        if any(u in fwd and where.get(u) != r for u in readers):
            continue        # a region's output: saved as the next one's input
        cand[v] = readers
    if not cand:
        return None
    succ = {v: {u for u in rs if u in cand and where[u] == where[v]} for v, rs in cand.items()}
    level: dict[int, int] = {}
    for v in sorted(cand, reverse=True):       # node ids are a topological order
        level[v] = 1 + max((level[u] for u in succ[v]), default=-1)
    copy: dict[int, str] = {}                  # op -> its recomputed copy's name
    batches = list(root.batches)
    for h in range(max(level.values()) + 1):
        specs = []
        for v in sorted(u for u in cand if level[u] == h):
            users = {g0.nodes[u].name for u in cand[v] if u in late}
            users |= {copy[u] for u in succ[v] if u in copy}
            if users:
                specs.append(Remat(g0.nodes[v].name, frozenset(users)))
        if not specs:
            continue
        before = {n.name for n in g.nodes}
        g, kept = space.apply(g, Batch("remat", frozenset(specs)))
        if not kept.specs:
            continue
        batches.append(kept)
        new = {n.name for n in g.nodes} - before
        for s in kept.specs:
            nm = _copy_name(g, new, s.op)
            if nm is not None:
                copy[ids[s.op]] = nm
    if len(batches) == len(root.batches):
        return None
    st = space.evaluate(root.plan, tuple(batches), g)
    st.meta["rule"] = "user-checkpoint"
    return st
