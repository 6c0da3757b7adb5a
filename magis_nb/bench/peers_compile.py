"""magis_nb's generated program compiled by inductor, its plan kept.

`compile_plan(mod)` replaces an `OptimizedModule`'s step function with
``torch.compile(step, backend=...)``; the module's swaps run through `HostOps`,
whose copies are opaque custom ops, and the backend rewrites the program's
dropout draws into one too (see Note [compiling a plan]) before it hands the
graph to inductor. The module is used as before
(``loss = mod(*inputs)``); the first call compiles.

Note [compiling a plan]: inductor fuses the program's ops and re-plans its
buffers (each freed at its last use, in the program's order), so re-ordering,
fission and rematerialization reach it as written. Two parts of a plan do not
survive as plain ATen:

- Swaps. A Store is a ``copy_`` into a host buffer that is a graph input. AOTAutograd
  functionalizes it into a new tensor holding the copy (alive until the Load
  reads it) and writes the inputs back at the end of the graph, so the swapped
  bytes stay allocated all along: GPT at the bench size, a plan with 64 swaps
  measured 19.1 MiB as plain ATen and 79.5 MiB compiled. As opaque ops (a Store
  that mutates its host buffer, a Load that returns a new tensor) they keep
  their place and their effect (18.2 MiB).
- Dropout. The program draws a mask as ``empty`` + ``bernoulli_`` (what eager
  does on the CPU). With ``fallback_random`` (eager's masks), inductor fused a
  reader of the mask into the kernel that allocates it, ahead of the
  ``bernoulli_`` that fills it (the GPT plan above: loss off by 1.4e-3). An
  opaque draw that returns the filled mask orders them by data. Opaque draws
  are pure ops to inductor, which may then run them in another order (other
  masks: GPT's re-order-only plan, gradients off by 3.8e-2), so each draw also
  takes the previous draw's (empty) token and returns the next.

One more rewrite is for inductor's speed, not for correctness: a tensor that
several convolutions read (a weight, read by its convolution and by its
convolution_backward; a ``cat`` of a U-Net skip, read by the next convolution
and by its backward) is converted to channels-last once, by an explicit
``clone``. Inductor converts the inputs of every convolution it runs
channels-last (its layout optimization), but a graph input or a ``cat`` gets one
copy per reader; in a joint forward + backward graph it then fuses the
backward's copy with the forward's, so the backward's copy is made in the
forward and held until the backward. U-Net at the bench size, re-order-only
plan: inductor's kernels took 102 ms a step with the copies, and the compiled
peak was 1.12x eager's (see `share_conv_inputs`).
"""
from __future__ import annotations

import operator

import torch
from torch import Tensor

aten = torch.ops.aten


@torch.library.custom_op("magis_nb::store_to_host", mutates_args=("pool",))
def store_to_host(pool: Tensor, x: Tensor) -> None:
    pool.copy_(x)


@store_to_host.register_fake
def _(pool, x):
    return None


@torch.library.custom_op("magis_nb::load_from_host", mutates_args=())
def load_from_host(pool: Tensor, device: torch.device) -> Tensor:
    return aten._to_copy.default(pool, device=device)  # always a copy


@load_from_host.register_fake
def _(pool, device):
    return torch.empty_like(pool, device=device)


@torch.library.custom_op("magis_nb::bernoulli", mutates_args=())
def bernoulli(after: Tensor, size: list[int], stride: list[int], dtype: torch.dtype,
              device: torch.device, p: float) -> tuple[Tensor, Tensor]:
    # the same draw as eager's native_dropout on the CPU: a new mask, filled in place.
    # ``after`` / the second output: an empty token that orders the draws by data
    return torch.empty_strided(size, stride, dtype=dtype, device=device).bernoulli_(p), after.new_empty(0)


@bernoulli.register_fake
def _(after, size, stride, dtype, device, p):
    return torch.empty_strided(size, stride, dtype=dtype, device=device), after.new_empty(0)


class HostOps:
    """The generated program's copies (runtime.copies) as the opaque ops above."""

    def store(self, k, pool, x):
        torch.ops.magis_nb.store_to_host.default(pool, x)

    def stored(self, k, pool):
        return pool

    def load(self, k, pool, dev):
        return torch.ops.magis_nb.load_from_host.default(pool, dev)

    def ready(self, k):
        pass

    def finish(self):
        pass


def _fresh(n) -> bool:
    """Is ``n`` a new, unfilled tensor (``empty_strided`` with its dtype and device)?"""
    return (isinstance(n, torch.fx.Node) and n.op == "call_function"
            and n.target is aten.empty_strided.default and len(n.args) == 2
            and {"dtype", "device"} <= set(n.kwargs)
            and set(n.kwargs) <= {"dtype", "device", "layout", "pin_memory"}
            and n.kwargs.get("layout", torch.strided) == torch.strided and not n.kwargs.get("pin_memory"))


def make_opaque(gm: torch.fx.GraphModule, example_inputs, pools) -> dict[str, int]:
    """Rewrite ``gm`` (a dynamo graph of a generated step run with `HostOps`) in
    place: ``bernoulli_`` on a fresh mask becomes the custom draw above. Returns
    how many draws, and how many Stores into ``pools`` and Loads from them the
    graph holds as opaque ops (every swap, or it raises)."""
    ptrs = {p.data_ptr() for p in pools}
    g = gm.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    pool_nodes = {n for n, x in zip(phs, example_inputs, strict=True)
                  if isinstance(x, Tensor) and x.data_ptr() in ptrs}
    counts = {"pools": len(pool_nodes), "stores": 0, "loads": 0, "draws": 0}
    token = None  # the last draw's token
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is torch.ops.magis_nb.store_to_host.default and n.args[0] in pool_nodes:
            counts["stores"] += 1
        elif n.target is torch.ops.magis_nb.load_from_host.default and n.args[0] in pool_nodes:
            counts["loads"] += 1
        elif (n.target is aten.bernoulli_.float and not n.kwargs and _fresh(n.args[0])
              and len(n.args[0].users) == 1):
            mask = n.args[0]  # only this draw reads it: nothing else sees it unfilled
            size, stride = mask.args
            with g.inserting_before(n):
                if token is None:
                    token = g.call_function(torch.empty, ((0,),))
                both = g.call_function(torch.ops.magis_nb.bernoulli.default,
                                       (token, size, stride, mask.kwargs["dtype"], mask.kwargs["device"],
                                        n.args[1]))
                new = g.call_function(operator.getitem, (both, 0))
                token = g.call_function(operator.getitem, (both, 1))
            n.replace_all_uses_with(new)
            g.erase_node(n)
            g.erase_node(mask)
            counts["draws"] += 1
    if counts["stores"] != counts["pools"] or counts["loads"] < counts["pools"]:
        raise RuntimeError(f"swaps not recognised in the generated program: {counts}")
    g.lint()
    gm.recompile()
    return counts


# convolution-family ops and the argument positions of their 4-D tensors (input, weight)
_CONV_ARGS = {aten.convolution.default: (0, 1), aten.convolution_backward.default: (1, 2)}


def _conv_reads(n: torch.fx.Node) -> list[tuple[torch.fx.Node, int]]:
    """(reader, position) for each convolution-family argument that is ``n``."""
    return [(u, i) for u in n.users if u.op == "call_function" and u.target in _CONV_ARGS
            for i in _CONV_ARGS[u.target] if u.args[i] is n]


def share_conv_inputs(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm`` in place: a graph input or ``cat`` that two or more
    convolution-family ops read is read through one channels-last ``clone``
    (see the module's note). Returns how many clones it inserted."""
    import torch._inductor.config as iconfig

    if not iconfig.layout_optimization:
        return 0  # inductor keeps convolutions in the tensors' own layout: nothing to share
    g = gm.graph
    pos = {n: i for i, n in enumerate(g.nodes)}
    added = 0
    for n in list(g.nodes):
        if not (n.op == "placeholder" or (n.op == "call_function" and n.target is aten.cat.default)):
            continue
        val = n.meta.get("example_value", n.meta.get("val"))
        reads = _conv_reads(n)
        if len(reads) < 2 or not isinstance(val, Tensor) or val.dim() != 4:
            continue
        with g.inserting_before(min((u for u, _ in reads), key=pos.__getitem__)):  # made when first read
            cl = g.call_function(aten.clone.default, (n,), {"memory_format": torch.channels_last})
        for u, i in reads:
            u.update_arg(i, cl)
        added += 1
    if added:
        g.lint()
        gm.recompile()
    return added


def compile_plan(mod, backend: str = "inductor", log: dict | None = None, share_conv: bool = True):
    """Compile ``mod``'s generated step (an `OptimizedModule`, changed in place and
    returned) with ``backend`` after `make_opaque` (and, for inductor, `share_conv_inputs`
    unless ``share_conv`` is False: `bench overhead` measures without it), its swaps
    through `HostOps`; ``log`` receives its counts."""
    from torch._dynamo.backends.registry import lookup_backend

    pools = list(mod.host_buffers)
    inner = lookup_backend(backend)

    def opaque_then(gm, example_inputs):
        counts = make_opaque(gm, example_inputs, pools)
        if backend == "inductor" and share_conv:
            counts["conv_inputs_shared"] = share_conv_inputs(gm)
        if log is not None:
            log.update(counts)
        return inner(gm, example_inputs)

    mod.copies = HostOps()
    mod.step_fn = torch.compile(mod.step_fn, backend=opaque_then, fullgraph=True)
    return mod
