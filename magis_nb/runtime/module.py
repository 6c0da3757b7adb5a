"""OptimizedModule: the user's parameters + a generated program that runs a step."""
from __future__ import annotations

import contextlib
import copy
from typing import Sequence

import torch
import torch.nn as nn

from ..capture.export import Captured, attribute
from ..capture.outputs import unflatten
from ..distributed.comm import LocalComm
from ..ir.graph import Graph
from ..rules.swap import pool_inputs, swap_ops
from .codegen import bucket_nodes, compile_source, generate, seeded
from .copies import copies_for, host_buffer


def held_host_bytes(t: torch.Tensor) -> int:
    """Host bytes ``t``'s storage holds: pinned blocks come from the caching host
    allocator, which rounds every request up to a power of two."""
    n = t.untyped_storage().nbytes()
    if n <= 1 or not t.is_pinned():
        return n
    return 1 << (n - 1).bit_length()


class _Box:
    """What `_PlannedStep.forward` hands over: the step's loss and gradients."""
    __slots__ = ("loss", "seed", "grads")

    def __init__(self, loss, seed, grads):
        self.loss, self.seed, self.grads = loss, seed, grads


class _PlannedStep(torch.autograd.Function):
    """The planned step as one autograd node: Note [the step behind autograd]."""

    @staticmethod
    def forward(ctx, box: _Box, *params):
        ctx.seed = box.seed
        ctx.has = [g is not None for g in box.grads]
        ctx.save_for_backward(*[g for g in box.grads if g is not None])
        box.grads = None
        return box.loss.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        saved = iter(ctx.saved_tensors)    # raises on a second backward, as eager does
        grads = [next(saved) if h else None for h in ctx.has]
        del saved
        return (None, *scaled(grads, grad_loss, ctx.seed))


def scaled(grads: list, grad_loss: torch.Tensor, seed: float) -> list:
    """The gradients for ``loss.backward(grad_loss)``: linear in the loss's
    gradient, so times ``grad_loss / seed`` ((k * loss).backward()). On the CPU
    the factor is read, and gradients seeded as asked are handed over untouched.
    Elsewhere reading it would wait for the whole step at every backward (a host
    sync): the gradients, which are the step's own, are scaled in place, and
    seeded as asked the factor is exactly 1, so they come out bit for bit."""
    if grad_loss.device.type == "cpu":
        if float(grad_loss) == seed:
            return grads
        k = grad_loss / seed
        return [g * k.to(g.dtype) if g is not None else None for g in grads]
    k = grad_loss / seed
    done = set()      # a tensor handed to two parameters is scaled once
    for g in grads:
        key = None if g is None else (g.data_ptr(), tuple(g.shape), g.stride(), g.dtype)
        if key is not None and key not in done:
            done.add(key)
            g.mul_(k.to(g.dtype))
    return grads


# Note [the step behind autograd]
# The program computes the loss and every gradient in one run (the planned
# schedule interleaves forward and backward), so `forward` runs all of it and an
# autograd node hands the gradients over when the user calls `loss.backward()`:
# its backward returns them to the parameters' AccumulateGrad nodes, where DDP's
# reducer hooks, post-accumulate-grad hooks and accumulation over micro-batches see
# them exactly as in eager; never calling backward leaves `.grad` untouched. The
# gradients are linear in the loss's gradient g, so `(k * loss).backward()` gets
# them times k. That product is exact only as a product: fp16 training needs the
# loss scale inside the backward (small intermediate gradients underflow first),
# so with a `GradScaler` attached (``grad_scaler``) the program's backward is seeded
# with the scaler's scale, the value `scaler.scale(loss).backward()` then passes in
# as g, and the gradients go to the parameters as computed. The saved gradients
# are freed by the first backward: a second one raises autograd's own error.


class OptimizedModule(nn.Module):
    """Runs the captured step in a planned order.

    Training (``mode="train"``): ``loss = m(*inputs)`` runs the planned forward
    *and* backward and returns the loss attached to the parameters; ``loss.backward()``
    hands the gradients to them through autograd (accumulating as autograd does, so
    hooks, DDP and gradient accumulation see them), and buffers (BatchNorm running
    stats) are updated during the call, as in eager. Any ``torch.optim`` optimizer
    works unchanged. With a ``torch.amp.GradScaler`` set as ``grad_scaler``, its
    scale seeds the program's backward (fp16 training). Called under
    ``torch.no_grad()`` or in eval mode it runs ``inference`` (an inference plan,
    when one is attached). ``step(*inputs)`` is the one-call form: forward and
    backward with the gradients accumulated at once, the loss detached.
    Inference (``mode="infer"``): returns the model's outputs.

    Swapped tensors go to pinned host buffers allocated once per plan. On a CUDA
    device the copies run asynchronously on a copy stream (`runtime.copies`);
    elsewhere they are synchronous. ``timed_copies=True`` times every transfer
    and wait (CUDA events; the host clock on the CPU, where every copy is a
    wait); `transfer_stats()` then reports the steps' since its last call.

    ``code`` is the generated program's source and ``step_fn`` the function it
    defines, ``step_fn(device, *tensors, _io=copies)``: parameters, buffers,
    inputs, lifted constants and ``host_buffers``, in that order, to the
    program's flat outputs. Assigning another function there (before a step)
    runs the same program another way: compiled by inductor
    (bench/peers_compile.py) or instrumented (search/divergence.py).
    ``host_buffers`` are the host tensors swapped values live in.
    """

    def __init__(self, model: nn.Module, cap: Captured, graph: Graph,
                 order: Sequence[int], source: str | None = None, comm=None):
        super().__init__()
        self.model = model
        self.captured = cap             # the step every plan of it rewrites (verify.Reference)
        self.mode = cap.mode
        self.order = list(order)
        self.code = source if source is not None else generate(graph, self.order)
        self.step_fn = compile_source(self.code)
        self._param_names = list(cap.param_names)
        self._buffer_names = list(cap.buffer_names)
        self._input_meta = list(cap.input_meta)
        self._call = cap.call
        self._consts = list(cap.constants.values())
        self._consts_on: dict = {}      # device -> the lifted constants there
        self._roles = list(cap.output_roles)
        self._out_spec = cap.out_spec
        # A gradient that shares storage with an input must not become p.grad
        # (a later in-place accumulation would write into the input): clone it.
        input_ids = {n.id for n in graph.inputs}
        self._clone_out = [graph.storage_of(r).node in input_ids for r in graph.outputs]
        # Host buffers for swapped tensors: allocated once per plan, reused on every
        # call (pinned when a GPU could copy from them asynchronously), with the
        # strides of the tensors they hold: views of a loaded copy were traced
        # against those (DESIGN.md §11 "Layout is semantics").
        pin = torch.cuda.is_available()
        self.host_buffers = [host_buffer(n.outputs[0].shape, n.outputs[0].stride,
                                         n.outputs[0].dtype, pin) for n in pool_inputs(graph)]
        stores, loads = swap_ops(graph)
        # the events a copies object keeps: one per Load and one per Store
        self._n_events = max(len(loads), len(stores)) if stores else 0
        self._swaps = bool(stores)
        self._copies = {}               # device -> copies object, made on first use
        self.timed_copies = False
        self._last_dev = None           # the device of the last step that swapped
        self.grad_scaler = None         # a torch.amp.GradScaler whose scale seeds the backward
        self._inference: list = []      # see `inference`
        self._seeded = seeded(graph)
        # A program with gradient buckets all_reduces them through ``comm``
        # (distributed/comm.py); one rank alone by default.
        self._bucketed = bool(bucket_nodes(graph))
        self.comm = comm if comm is not None else (LocalComm() if self._bucketed else None)
        # A copies object to use on every device instead (e.g. one whose copies are
        # opaque custom ops, for torch.compile: bench/peers_compile.py).
        self.copies = None

    def copies_on(self, dev: torch.device):
        """The copies object this module's swaps run through on ``dev`` (the
        generated program's ``_io``; `runtime.copies`): made on first use."""
        if self.copies is not None:
            return self.copies
        key = (dev, self.timed_copies)
        if key not in self._copies:
            self._copies[key] = copies_for(dev, max(self._n_events, 1), timed=self.timed_copies)
        return self._copies[key]

    def transfer_stats(self):
        """`TransferStats` of the steps since the last call (needs ``timed_copies = True``)."""
        io = self._copies.get((self._last_dev, True))
        if io is None or not hasattr(io, "stats"):
            raise RuntimeError("no timed step ran: set timed_copies = True and run a step first")
        return io.stats()

    def _tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The call's tensors, in the order the program takes them."""
        if self._call is not None:
            return self._call.tensors(args, kwargs)
        if kwargs:
            raise TypeError("this module takes positional inputs only")
        return list(args)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers swapped tensors live in between Store and Load:
        host memory on a GPU; on the CPU the same RAM as everything else. A pinned
        buffer counts what PyTorch's caching host allocator takes for it: its size
        rounded up to a power of two."""
        return sum(held_host_bytes(p) for p in self.host_buffers)

    def resident(self) -> list[torch.Tensor]:
        """Tensors the module itself keeps between steps on the compute device (the
        lifted constants): with the model's weights, the memory a step starts from."""
        return [c for cs in self._consts_on.values() for c in cs] or list(self._consts)

    def _constants(self, dev: torch.device) -> list[torch.Tensor]:
        if dev not in self._consts_on:
            self._consts_on[dev] = [c.to(dev) for c in self._consts]
        return self._consts_on[dev]

    def _check(self, inputs) -> None:
        if len(inputs) != len(self._input_meta):
            raise TypeError(f"this module was planned for {len(self._input_meta)} inputs, "
                            f"got {len(inputs)}")
        names = self._call.names() if self._call is not None else range(len(inputs))
        for name, x, (shape, dtype) in zip(names, inputs, self._input_meta):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {name} must be a tensor, got {type(x).__name__}")
            if tuple(x.shape) != shape or x.dtype != dtype:
                raise ValueError(
                    f"input {name} has shape {tuple(x.shape)} ({x.dtype}) but this module "
                    f"was planned for {shape} ({dtype}); shapes are specialized: "
                    "optimize again with example inputs of the new shape")

    # -- running a step ------------------------------------------------------------
    def _run(self, inputs: list, params: dict, buffers: dict, seed: float = 1.0) -> list:
        """The program's flat outputs for ``inputs`` (``seed``: the backward's seed,
        the loss's gradient; 1.0 unless a GradScaler scales the loss)."""
        args = [params[n] for n in self._param_names]
        args += [buffers[n] for n in self._buffer_names]
        # the compute device is the model's: an input may live elsewhere (a CPU
        # tensor of lengths the model moves itself); a model without weights
        # computes where its first input is
        dev = next((t.device for t in args), inputs[0].device if inputs else torch.device("cpu"))
        args += list(inputs)
        args += self._constants(dev)
        args += self.host_buffers
        kw = {"_seed": seed} if seed != 1.0 else {}
        if kw and not self._seeded:
            raise RuntimeError("this program has no backward seed to scale (it was not "
                               "captured with a loss); run it without a GradScaler")
        # The capture recorded autocast's casts as ops of the program: run it as
        # recorded, not autocast a second time (a user's `with torch.autocast`).
        amp = torch.autocast(dev.type, enabled=False) if dev.type in ("cpu", "cuda") \
            else contextlib.nullcontext()
        with torch.no_grad(), amp:
            if self._swaps:
                self._last_dev = dev
                kw["_io"] = self.copies_on(dev)
            if self._bucketed:
                kw["_comm"] = self.comm
            outs = self.step_fn(dev, *args, **kw)
        del args
        return list(outs)

    def _split(self, outs: list, params: dict, buffers: dict):
        """(loss, {param name: gradient}) of a training step's outputs; buffer
        updates (BatchNorm running stats) are written in place, as eager's forward does."""
        loss, grads = None, {}
        with torch.no_grad():
            for o, role, clone in zip(outs, self._roles, self._clone_out):
                kind = role[0]
                if kind == "loss":
                    loss = o
                elif kind == "grad":
                    grads[role[1]] = o.clone() if clone else o
                elif kind == "buffer":
                    buffers[role[1]].copy_(o)
        return loss, grads

    def _execute(self, args: tuple, kwargs: dict, seed: float = 1.0, *, input_grads: bool = True):
        """Run the program on a call's inputs: (outputs, None, None) for an
        inference plan, else (loss, {param name: gradient}, parameters by name),
        buffers updated. ``input_grads=False`` refuses inputs that require grad."""
        inputs = self._tensors(args, kwargs)
        self._check(inputs)
        if not input_grads and any(x.requires_grad for x in inputs):
            raise ValueError("an input requires grad: the planned backward computes the "
                             "parameters' gradients only; pass inputs.detach() (or leave "
                             "the step to eager PyTorch)")
        # by their first names: a tied weight is one graph input (capture/export.py)
        params, buffers = dict(self.model.named_parameters()), dict(self.model.named_buffers())
        for n in self._buffer_names:
            if n not in buffers:        # Note [plain tensor attributes]
                buffers[n] = attribute(self.model, n)
        outs = self._run(inputs, params, buffers, seed)
        if self.mode == "infer":
            return self._outputs(outs), None, None
        loss, grads = self._split(outs, params, buffers)
        return loss, grads, params

    def step(self, *args, **kwargs):
        """One training step in one call: forward *and* backward, gradients
        accumulated into ``p.grad`` as autograd does (assigned when ``None``,
        added otherwise), buffers updated; returns the loss, detached. (Inference
        plans: the model's outputs.) This is what `forward` does before the
        gradients are handed over by ``loss.backward()``; benchmarks and checks
        against eager call it directly."""
        loss, grads, params = self._execute(args, kwargs)
        if self.mode == "infer":
            return loss
        with torch.no_grad():
            for name, g in grads.items():
                p = params[name]
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        return loss

    def _outputs(self, outs: list):
        leaves = [o.clone() if c else o for o, c in zip(outs, self._clone_out)]
        return unflatten(leaves, self._out_spec)

    def forward(self, *args, **kwargs):
        """Training plans: the loss, attached to the parameters through autograd
        (see the class doc and Note [the step behind autograd]). Inference plans:
        the model's outputs."""
        if self.mode == "infer":
            return self.step(*args, **kwargs)
        if not (torch.is_grad_enabled() and self.training):
            if self.inference is not None:
                return self.inference(*args, **kwargs)
            why = "under torch.no_grad()" if self.training else "in eval mode"
            raise RuntimeError(
                f"this module runs a planned training step (forward and backward), called "
                f"{why}: plan the forward too, `model_opt.inference = magis_nb.optimize("
                f"model, inputs, mode='infer').module`, or call the model itself")
        seed = self._loss_seed()
        loss, grads, params = self._execute(args, kwargs, seed, input_grads=False)
        ps = [params[n] for n in self._param_names]
        gs = [grads.get(n) if p.requires_grad else None for n, p in zip(self._param_names, ps)]
        del grads
        return _PlannedStep.apply(_Box(loss, seed, gs), *ps)

    def _loss_seed(self) -> float:
        sc = self.grad_scaler
        if sc is None or not sc.is_enabled():
            return 1.0
        return float(sc.get_scale())

    @property
    def inference(self):
        """The module run when this training plan is called under ``torch.no_grad()``
        or in eval mode (an inference plan of the same model), or None."""
        return self._inference[0] if self._inference else None

    @inference.setter
    def inference(self, mod) -> None:
        if mod is not None and getattr(mod, "mode", "infer") != "infer":
            raise ValueError("inference must be an inference plan (mode='infer')")
        # kept outside _modules: the same parameters must not appear twice in state_dict
        self._inference = [mod] if mod is not None else []

    def __setattr__(self, name, value):
        if name == "inference":     # nn.Module would register a module value as a child
            OptimizedModule.inference.fset(self, value)
        else:
            super().__setattr__(name, value)

    def widened(self, model: nn.Module, dtype: torch.dtype = torch.float64) -> "OptimizedModule":
        """The same plan (program, order, swaps, parts) run in ``dtype`` on ``model``,
        a copy of this module's model with its float32 tensors in ``dtype``: what
        the checks against eager hold to float64 (Note [checked in float64] in
        verify.py). The program's float32 dtype arguments, input dtypes, lifted
        constants and host buffers become ``dtype``; nothing else of the plan
        changes. Raises ValueError for a program that computes in bf16/fp16 (an
        autocast region: widening it would not be the same program)."""
        if any(s in self.code for s in ("torch.bfloat16", "torch.float16")):
            raise ValueError("the program computes in low precision (autocast casts): "
                             "widening it would check another program")
        w = copy.copy(self)
        # nn.Module keeps children, parameters and buffers in dicts: the copy gets
        # its own, so binding ``model`` leaves this module's as it is
        for d in ("_modules", "_parameters", "_buffers"):
            object.__setattr__(w, d, dict(getattr(self, d)))
        w.model = model
        wide = lambda t: t.to(dtype) if t.dtype == torch.float32 else t  # noqa: E731
        w.code = self.code.replace("torch.float32", repr(dtype))
        w.step_fn = compile_source(w.code)
        w._input_meta = [(shape, dtype if dt == torch.float32 else dt)
                         for shape, dt in self._input_meta]
        w._consts = [wide(c) for c in self._consts]
        w._consts_on = {}
        w.host_buffers = [host_buffer(tuple(b.shape), b.stride(), dtype if b.dtype == torch.float32
                                      else b.dtype, b.is_pinned()) for b in self.host_buffers]
        w._copies = {}
        w._inference = []
        w.copies = None
        return w

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, ops={len(self.order)}"


def step_of(runner):
    """The one-call step (`OptimizedModule.step`: forward, backward and the
    gradients on the parameters) of a plan's module; any other callable as it is."""
    return runner.step if isinstance(runner, OptimizedModule) else runner
