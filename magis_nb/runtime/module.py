"""OptimizedModule: the user's parameters + a generated program that runs a step."""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn as nn

from ..capture.export import Captured
from ..capture.outputs import unflatten
from ..ir.graph import Graph
from ..rules.swap import pool_inputs, swap_ops
from .codegen import compile_source, generate
from .copies import copies_for, host_buffer


class OptimizedModule(nn.Module):
    """Runs the captured step in a planned order.

    Training (``mode="train"``): ``loss = m(*inputs)`` runs forward *and* backward;
    gradients accumulate into ``p.grad`` as autograd does (assigned when ``None``,
    added otherwise) and buffers (BatchNorm running stats) are updated in place, so
    any ``torch.optim`` optimizer works unchanged. The returned loss is detached:
    do not call ``.backward()`` on it. Inference: returns the model's outputs.

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
                 order: Sequence[int], source: str | None = None):
        super().__init__()
        self.model = model
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
        self._n_loads = len(loads) if stores else 0
        self._swaps = bool(stores)
        self._copies = {}               # device -> copies object, made on first use
        self.timed_copies = False
        self._last_dev = None           # the device of the last step that swapped
        # A copies object to use on every device instead (e.g. one whose copies are
        # opaque custom ops, for torch.compile: bench/peers_compile.py).
        self.copies = None

    def _io(self, dev: torch.device):
        if self.copies is not None:
            return self.copies
        key = (dev, self.timed_copies)
        if key not in self._copies:
            self._copies[key] = copies_for(dev, max(self._n_loads, 1), timed=self.timed_copies)
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
        host memory on a GPU; on the CPU the same RAM as everything else."""
        return sum(p.untyped_storage().nbytes() for p in self.host_buffers)

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

    def forward(self, *args, **kwargs):
        inputs = self._tensors(args, kwargs)
        self._check(inputs)
        # by their first names: a tied weight is one graph input (capture/export.py)
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        args = [params[n] for n in self._param_names]
        args += [buffers[n] for n in self._buffer_names]
        dev = inputs[0].device
        args += list(inputs)
        args += self._constants(dev)
        args += self.host_buffers
        # The capture recorded autocast's casts as ops of the program: run it as
        # recorded, not autocast a second time (a user's `with torch.autocast`).
        amp = torch.autocast(dev.type, enabled=False) if dev.type in ("cpu", "cuda") \
            else contextlib.nullcontext()
        with torch.no_grad(), amp:
            if self._swaps:
                self._last_dev = dev
                outs = self.step_fn(dev, *args, _io=self._io(dev))
            else:
                outs = self.step_fn(dev, *args)
        del args
        if self.mode == "infer":
            leaves = [o.clone() if c else o for o, c in zip(outs, self._clone_out)]
            return unflatten(leaves, self._out_spec)
        loss = None
        with torch.no_grad():
            for o, role, clone in zip(outs, self._roles, self._clone_out):
                kind = role[0]
                if kind == "loss":
                    loss = o
                elif kind == "grad":
                    p = params[role[1]]
                    if p.grad is None:
                        p.grad = o.clone() if clone else o
                    else:
                        p.grad.add_(o)
                elif kind == "buffer":
                    buffers[role[1]].copy_(o)
        return loss

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, ops={len(self.order)}"
