"""Where the user's ``torch.utils.checkpoint`` regions are in a captured graph.

Note [the user's checkpoint regions]
``aot_export_module`` traces with saved-tensor hooks disabled, so a
non-reentrant checkpoint is inlined: the captured program saves every
activation of the region and nothing in it says a region was there (torch
2.13: no ``recompute`` or ``ac_graph_id`` meta on any node; dynamo sets those,
and the export runs without it). A reentrant checkpoint does not trace at all:
its backward refuses ``torch.autograd.grad`` ("When use_reentrant=True,
torch.utils.checkpoint is incompatible with .grad()").

While a capture runs, `marked_checkpoints` therefore
- runs each non-reentrant region's forward under ``fx.traceback.annotate``
  (``node.meta["custom"][KEY]`` = a region number) with node meta preserved:
  the first graph the export builds (``_aot_export_function``'s joint graph,
  kept by wrapping that function) has the tag on the region's forward ops and,
  copied by autograd's sequence numbers, on their backward ops;
- runs a reentrant region (``CheckpointFunction.apply``) as the non-reentrant
  one on the same function and RNG setting: the same values and gradients
  (where no input requires grad, reentrant checkpoint's outputs do not, and
  the region's parameters get no gradient: the function then runs under
  ``no_grad``, as reentrant's forward does).
The export's final graph is a retrace of that first graph's code, which keeps
no meta; each of its nodes' ``stack_trace`` is the line of the first graph's
code that made it (``gelu = torch.ops.aten.gelu.default(view_1)``), and
`region_tags` reads the tag back through that name. Where this torch lacks any
of it, nothing is tagged and the capture is the same as without.
"""
from __future__ import annotations

import contextlib
import itertools
import re

import torch

KEY = "magis_checkpoint"
_ASSIGN = re.compile(r"\s*([A-Za-z_]\w*)\s*=")


class Marks:
    """What a capture under `marked_checkpoints` saw: the export's first joint
    graph, and which region numbers came from reentrant calls."""

    def __init__(self):
        self.first = None           # the joint GraphModule `_aot_export_function` made
        self.reentrant: set = set()


@contextlib.contextmanager
def marked_checkpoints():
    """Tags the ops of ``torch.utils.checkpoint`` regions while a capture runs
    (Note [the user's checkpoint regions]); yields the `Marks`."""
    marks = Marks()
    try:
        import torch.fx.traceback as fxt
        import torch.utils.checkpoint as cp
        import torch._functorch.aot_autograd as aa
        annotate = fxt.annotate
        orig_gen, orig_fn = cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction
        orig_export = aa._aot_export_function
    except (ImportError, AttributeError):
        yield marks
        return
    ids = itertools.count()
    reentrant = [False]

    def gen(*args, **kwargs):
        inner = orig_gen(*args, **kwargs)
        rid = next(ids)
        if reentrant[0]:
            marks.reentrant.add(rid)
        with annotate({KEY: rid}):
            next(inner)
            try:
                yield
            except BaseException as e:  # noqa: BLE001 - the generator's own handling
                inner.throw(e)
                raise
        next(inner, None)

    class Reentrant:
        """``CheckpointFunction`` as ``checkpoint`` calls it: its ``apply``."""

        @staticmethod
        def apply(function, preserve, *args):
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                with torch.no_grad():
                    return function(*args)
            reentrant[0] = True
            try:
                return cp.checkpoint(function, *args, use_reentrant=False,
                                     preserve_rng_state=preserve)
            finally:
                reentrant[0] = False

    def export(*args, **kwargs):
        out = orig_export(*args, **kwargs)
        marks.first = out[0]
        return out

    cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = gen, Reentrant
    aa._aot_export_function = export
    try:
        with fxt.preserve_node_meta():
            yield marks
    finally:
        cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = orig_gen, orig_fn
        aa._aot_export_function = orig_export


def region_tags(gm: torch.fx.GraphModule, marks: Marks) -> tuple[dict, dict, tuple]:
    """(forward op name -> region, backward op name -> region, reentrant
    regions) of the export's final graph ``gm``: each node read back through its
    stack trace to the first graph's node of the same target (Note [the user's
    checkpoint regions]); backward is the first graph's ``partitioner_tag``
    (autograd's backward ops carry their forward op's tag). Regions are
    numbered 0.. in the order their first op appears."""
    first = marks.first
    if not isinstance(first, torch.fx.GraphModule):
        return {}, {}, ()
    tag, target, backward = {}, {}, set()
    for n in first.graph.nodes:
        custom = n.meta.get("custom")
        if isinstance(custom, dict) and KEY in custom:
            tag[n.name] = custom[KEY]
            if n.meta.get("partitioner_tag") == "is_backward" or n.meta.get("autograd_backward"):
                backward.add(n.name)
        target[n.name] = n.target
    if not tag:
        return {}, {}, ()
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    number: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        lines = (n.meta.get("stack_trace") or "").strip().splitlines()
        m = _ASSIGN.match(lines[-1]) if lines else None
        src = m.group(1) if m else None
        if src in tag and target.get(src) == n.target:
            (bwd if src in backward else fwd)[n.name] = number.setdefault(tag[src], len(number))
    return fwd, bwd, tuple(sorted(number[r] for r in marks.reentrant if r in number))
