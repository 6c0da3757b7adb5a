"""Captured FX graph -> IR Graph."""
from __future__ import annotations

import keyword
import operator
import re

import torch
import torch.fx as fx

from ..capture.export import CaptureError, Captured
from ..capture.specialize import EXPECT, SCALAR_OPS
from .graph import Graph, Node, Ref, TensorInfo

# _unsafe_view returns a tensor sharing its input's storage but has no alias
# annotation in its schema (it is "unsafe" precisely because autograd does not
# track it as a view).
_UNANNOTATED_VIEWS = {"aten._unsafe_view.default"}


def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        return f"{ns}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _storage_bytes(val: torch.Tensor) -> int:
    try:
        return int(val.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - some fake tensors have no storage object
        return val.numel() * val.element_size()


# CPU losses whose reduced value is a view of the unreduced loss's buffer
_UNREDUCED_CPU_LOSSES = (torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default)


def _kernel_bytes(fn: fx.Node, val: torch.Tensor) -> int:
    """The storage the kernel really allocates for ``val``, where it is more than
    the result's: CPU ``mse_loss`` and ``smooth_l1_loss`` with a reduction compute
    the unreduced loss and return the reduced scalar as a view of that buffer
    (measured: 4096 bytes for a 4-byte loss over 1024 elements). ``col2im`` (``F.fold``) allocates its
    output ``empty_like`` its input and resizes it, on the CPU and in CUDA's
    kernel alike: where the columns are larger than the image (overlapping
    windows) the storage stays theirs (measured: 49152 bytes for a 12288-byte
    fold of 4x48x64 columns)."""
    nbytes = _storage_bytes(val)
    if fn.target is torch.ops.aten.col2im.default:
        x = fn.args[0].meta.get("val")
        if isinstance(x, torch.Tensor):
            nbytes = max(nbytes, x.numel() * x.element_size())
    if fn.target in _UNREDUCED_CPU_LOSSES and val.device.type == "cpu":
        red = fn.args[2] if len(fn.args) > 2 else fn.kwargs.get("reduction", 1)
        x = fn.args[0].meta.get("val")
        if red != 0 and isinstance(x, torch.Tensor):
            nbytes = max(nbytes, x.numel() * x.element_size())
    return nbytes


def alias_arg(target, out_index: int) -> int | None:
    """Which positional argument output ``out_index`` of ``target`` aliases."""
    if op_name(target) in _UNANNOTATED_VIEWS:
        return 0
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    rets = schema.returns
    ret = rets[min(out_index, len(rets) - 1)]  # Tensor(a)[] covers every element
    if ret.alias_info is None:
        return None
    sets = ret.alias_info.before_set
    if not sets:
        # ``Tensor(a)[]`` (split, unbind, chunk): the alias set sits on the list's
        # elements, out of the binding's reach; the views share the aliased input's
        # storage (counting them as new storages overstated attention peaks by 10%)
        return next((i for i, a in enumerate(schema.arguments) if a.alias_info is not None), None)
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.before_set & sets:
            return i
    return None


def unique_ident(name: str, taken: set[str]) -> str:
    """``name`` made a valid Python identifier not in ``taken`` (and added to it)."""
    s = re.sub(r"\W", "_", name)
    if not s or s[0].isdigit() or keyword.iskeyword(s) or s in ("torch", "aten"):
        s = "v_" + s
    base, k = s, 1
    while s in taken:
        k += 1
        s = f"{base}_{k}"
    taken.add(s)
    return s


def _is_rng(target, args=(), kwargs=None) -> bool:
    """Draws from the RNG. Fused attention is tagged as seeded because it can
    drop out; with ``dropout_p == 0`` it draws nothing (and may be split and
    recomputed like any other op)."""
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    schema = getattr(target, "_schema", None)
    if schema is not None and "scaled_dot_product" in schema.name:
        for i, a in enumerate(schema.arguments):
            if a.name == "dropout_p":
                p = args[i] if i < len(args) else (kwargs or {}).get("dropout_p", a.default_value)
                return bool(p)
    return True


def build_graph(cap: Captured) -> Graph:
    g = cap.gm.graph
    nodes: list[Node] = []
    ref_of: dict[fx.Node, object] = {}     # fx node -> Ref or tuple of Refs
    taken: set[str] = set()
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    n_p, n_b = len(cap.param_names), len(cap.buffer_names)
    for k, ph in enumerate(placeholders):
        if k < n_p:
            role, cat, nm = ("param", cap.param_names[k]), "weight", "p_" + cap.param_names[k]
        elif k < n_p + n_b:
            role, cat, nm = ("buffer", cap.buffer_names[k - n_p]), "buffer", "b_" + cap.buffer_names[k - n_p]
        else:
            role, cat, nm = ("input", k - n_p - n_b), "input", f"x{k - n_p - n_b}"
        val = ph.meta["val"]
        # one placeholder per distinct tensor: a tied weight is one input (Note [one
        # placeholder per parameter], capture/export.py)
        nbytes = _storage_bytes(val)
        if k < len(cap.input_storage):   # the real storage, where larger than the view
            nbytes = max(nbytes, cap.input_storage[k])
        info = TensorInfo(tuple(val.shape), val.dtype, nbytes)
        node = Node(id=len(nodes), name=unique_ident(nm, taken), kind="input", target="input",
                    outputs=[info], category=cat, role=role)
        nodes.append(node)
        ref_of[ph] = Ref(node.id, 0)
    # Lifted tensor constants come after the user's inputs: the module passes them
    # there (``Captured.constants``, in graph order).
    for fn in g.nodes:
        if fn.op != "get_attr":
            continue
        val = getattr(cap.gm, fn.target)
        node = Node(id=len(nodes), name=unique_ident("c" + fn.target, taken), kind="input",
                    target="input", outputs=[TensorInfo(tuple(val.shape), val.dtype,
                                                        _storage_bytes(val))],
                    category="buffer", role=("const", fn.target))
        nodes.append(node)
        ref_of[fn] = Ref(node.id, 0)
    scalars = iter(cap.specialized)

    def conv(a):
        if isinstance(a, fx.Node):
            r = ref_of[a]
            if not isinstance(r, Ref):
                raise NotImplementedError(f"tuple value {a.name} used directly")
            return r
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, dict):
            return {k: conv(v) for k, v in a.items()}
        return a

    for fn in g.nodes:
        if fn.op != "call_function":
            continue
        if fn.target is operator.getitem:
            src, idx = fn.args
            ref_of[fn] = ref_of[src][idx]
            continue
        args, kwargs = conv(tuple(fn.args)), conv(dict(fn.kwargs))
        target = fn.target
        if target in SCALAR_OPS:
            # a value the capture specialized on: the program checks it again
            value, where = next(scalars, (None, None))
            if where is None:
                raise CaptureError(f"{fn.name}: a value read off a tensor that the capture "
                                   "did not record (Note [specialized scalars])")
            target, args, kwargs = EXPECT, (args[0], value, where), {}
        val = fn.meta.get("val")
        multi = isinstance(val, (tuple, list))
        vals = [] if target is EXPECT else list(val) if multi else [val]
        outs: list[TensorInfo | None] = []
        nid = len(nodes)
        for i, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                outs.append(None)
                continue
            ai = alias_arg(fn.target, i)
            alias = None
            if ai is not None:
                src = args[ai] if ai < len(args) else None
                alias = src if isinstance(src, Ref) else None
            outs.append(TensorInfo(tuple(v.shape), v.dtype,
                                   0 if alias is not None else _kernel_bytes(fn, v), alias,
                                   tuple(v.stride()), v.device.type))
        node = Node(id=nid, name=unique_ident(fn.name, taken), kind="op", target=op_name(target),
                    op=target, args=args, kwargs=kwargs, outputs=outs,
                    rng=_is_rng(target, args, kwargs), multi=multi)
        nodes.append(node)
        ref_of[fn] = tuple(Ref(nid, i) for i in range(len(outs))) if multi else Ref(nid, 0)

    outputs = [conv(a) for a in cap.gm.graph.output_node().args[0]]
    _categorize(nodes, outputs, cap.output_roles)
    return Graph(nodes, outputs, cap.output_roles)


def _categorize(nodes: list[Node], outputs: list[Ref], roles: list[tuple]) -> None:
    """Activation in the forward, gradient after the loss, loss and buffer updates."""
    loss = [r for r, role in zip(outputs, roles) if role[0] == "loss"]
    backward: set[int] = set()
    if loss:
        succ: dict[int, list[int]] = {}
        for n in nodes:
            for r in n.refs():
                succ.setdefault(r.node, []).append(n.id)
        stack = list(succ.get(loss[0].node, []))
        while stack:
            v = stack.pop()
            if v not in backward:
                backward.add(v)
                stack.extend(succ.get(v, []))
        nodes[loss[0].node].category = "loss"
    for n in nodes:
        if n.kind == "op" and n.id in backward:
            n.category = "gradient"
    for r, role in zip(outputs, roles):
        # A multi-output op (batch_norm) also makes activations: leave it be.
        if role[0] == "buffer" and nodes[r.node].kind == "op" and len(nodes[r.node].outputs) == 1:
            nodes[r.node].category = "buffer"
