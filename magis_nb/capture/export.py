"""nn.Module + example inputs + loss -> ATen graph (joint training step or forward).

The graph is traced on FakeTensors by ``aot_export_module``: shapes and dtypes are
known for every node, and no activation is ever allocated, so paper-sized models
(built on the meta device) capture in seconds.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .outputs import find_loss, flatten

TORCH_DIR = os.path.dirname(torch.__file__)
PKG_DIR = os.path.dirname(os.path.dirname(__file__))


class CaptureError(ValueError):
    """The model could not be captured; the message says why and what to do."""

    def __init__(self, message: str, source_line: str | None = None):
        self.source_line = source_line
        if source_line:
            message = f"{message}\n  at {source_line}"
        super().__init__(message)


@dataclass
class Captured:
    gm: torch.fx.GraphModule
    mode: str                               # "train" | "infer"
    param_names: list[str]                  # placeholder order, names in the user model
    buffer_names: list[str]
    input_meta: list[tuple[tuple[int, ...], torch.dtype]]
    # One role per graph output, in order: ("loss",), ("grad", param_name),
    # ("buffer", buffer_name) for a buffer's new value, ("output", leaf_index).
    output_roles: list[tuple]
    out_spec: Any = None                    # infer: structure of the model's output
    no_grad_params: list[str] = field(default_factory=list)
    # Tied weights: aot_export_module gives every name of a shared parameter its
    # own placeholder; the second name maps to the first (same storage).
    tied: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def n_inputs(self) -> int:
        return len(self.input_meta)


class _Step(nn.Module):
    """Wraps the user's model so that the traced function returns a flat tuple."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, mode: str):
        super().__init__()
        self.model = model
        # Not registered as a submodule: a loss module's buffers are not the model's.
        object.__setattr__(self, "_loss_fn", loss_fn)
        object.__setattr__(self, "_mode", mode)
        object.__setattr__(self, "out_spec", None)

    def forward(self, *inputs):
        if self._mode == "infer":
            leaves, spec = flatten(self.model(*inputs))
            object.__setattr__(self, "out_spec", spec)
            return tuple(leaves)
        if self._loss_fn is not None:
            loss = self._loss_fn(self.model(*inputs[:-1]), inputs[-1])
        else:
            loss = find_loss(self.model(*inputs))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
            raise CaptureError(
                f"the loss must be a scalar tensor, got {shape}; reduce it "
                "(e.g. .mean()) in the model or in loss_fn")
        return (loss,)


def eager_step(model: nn.Module, inputs, loss_fn: Callable | None = None,
               mode: str = "train"):
    """Run one step eagerly with capture's calling convention (the reference).

    Training: forward, loss, ``loss.backward()``; returns the detached loss.
    Inference: returns the model's output.
    """
    inputs = _check_inputs(inputs)
    if mode == "infer":
        with torch.no_grad():
            return model(*inputs)
    loss = _Step(model, loss_fn, "train")(*inputs)[0]
    loss.backward()
    return loss.detach()


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback line in user code (not torch, not magis_nb)."""
    best = None
    for fs in traceback.extract_tb(exc.__traceback__):
        f = os.path.abspath(fs.filename)
        if f.startswith(TORCH_DIR) or f.startswith(PKG_DIR) or "site-packages" in f:
            continue
        best = f"{fs.filename}:{fs.lineno}: {fs.line or ''}".rstrip()
    return best


def _explain(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = type(exc).__name__
    text = str(exc)
    if ("data-dependent" in text or "DataDependent" in name or "GuardOnDataDependent" in name
            or "Could not guard on data-dependent" in text):
        return ("forward() has Python control flow that depends on tensor values "
                "(an `if`/`while` on a tensor, .item(), .tolist()); make it "
                f"shape-only or use torch.where ({name}: {msg})")
    if "does not require gradients" in text:
        return ("the loss does not depend on any trainable parameter: nothing to train "
                "(use mode='infer' for a forward pass)")
    if isinstance(exc, (RuntimeError, IndexError)) and (
            "shape" in text or "size" in text or "dim" in text or "mat" in text
            or "expected" in text.lower() or "out of range" in text):
        return f"the example inputs do not fit the model: {msg}"
    return f"tracing the model failed ({name}: {msg})"


def _check_inputs(inputs: Sequence[Any]) -> tuple:
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    inputs = tuple(inputs)
    if not inputs:
        raise CaptureError("no example inputs given: pass a tensor or a tuple of tensors")
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise CaptureError(
                f"example input {i} is a {type(x).__name__}, not a tensor: pass only "
                "tensors; bind other arguments with functools.partial or store them "
                "on the module")
    return inputs


def _unused_params(step: _Step, inputs: tuple) -> list[str]:
    """Names of trainable params that get no gradient, found on FakeTensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    named = dict(step.model.named_parameters())
    with mode:
        fparams = {n: mode.from_tensor(p).requires_grad_(p.requires_grad) for n, p in named.items()}
        fbufs = {n: mode.from_tensor(b) for n, b in step.model.named_buffers()}
        finputs = [mode.from_tensor(x) for x in inputs]
        out = torch.func.functional_call(step, {**{f"model.{k}": v for k, v in fparams.items()},
                                               **{f"model.{k}": v for k, v in fbufs.items()}},
                                         tuple(finputs))
        want = [n for n, p in fparams.items() if p.requires_grad]
        grads = torch.autograd.grad(out[0], [fparams[n] for n in want], allow_unused=True)
    return [n for n, g in zip(want, grads) if g is None]


@contextlib.contextmanager
def _frozen(model: nn.Module, names: list[str]):
    params = dict(model.named_parameters())
    saved = [(params[n], params[n].requires_grad) for n in names]
    try:
        for p, _ in saved:
            p.requires_grad_(False)
        yield
    finally:  # the user's model must come back exactly as it was
        for p, rg in saved:
            p.requires_grad_(rg)


def capture(model: nn.Module, inputs, *, loss_fn: Callable | None = None,
            mode: str = "train") -> Captured:
    """Trace one training step (``mode="train"``) or the forward (``"infer"``).

    Training: the model is called as ``model(*inputs[:-1])`` and the loss is
    ``loss_fn(output, inputs[-1])``; without ``loss_fn`` the model gets all inputs
    and must return its own loss (a scalar, ``out["loss"]``, ``out.loss`` or ``out[0]``).
    """
    from torch._functorch.aot_autograd import aot_export_module

    if mode not in ("train", "infer"):
        raise CaptureError(f"mode must be 'train' or 'infer', got {mode!r}")
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected an nn.Module, got {type(model).__name__}")
    inputs = _check_inputs(inputs)
    if mode == "train" and loss_fn is not None and len(inputs) < 2:
        raise CaptureError("with loss_fn the last input is the target: pass (inputs..., target)")
    step = _Step(model, loss_fn, mode)
    t0 = time.perf_counter()
    no_grad: list[str] = []

    def export():
        if mode == "infer":
            with torch.no_grad():
                return aot_export_module(step, list(inputs), trace_joint=False)
        return aot_export_module(step, list(inputs), trace_joint=True, output_loss_index=0)

    # fake_tensor logs every failed meta kernel at ERROR; the CaptureError says it once.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    old_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        try:
            gm, sig = export()
        except AssertionError as e:
            if "did not receive a gradient" not in str(e):
                raise
            no_grad = _unused_params(step, inputs)
            with _frozen(model, no_grad):
                gm, sig = export()
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - every trace failure becomes a CaptureError
        raise CaptureError(_explain(e), _user_frame(e)) from e
    finally:
        fake_log.setLevel(old_level)

    strip = len("model.")
    param_names = [n[strip:] for n in sig.parameters]
    buffer_names = [n[strip:] for n in sig.buffers]
    out_names = [a.name for a in gm.graph.output_node().args[0]]
    # aot_export_module orders outputs: buffer mutations, user outputs, gradients.
    n_mut, n_user = len(sig.buffers_to_mutate), len(sig.user_outputs)
    grads = sig.backward_signature.gradients_to_parameters if sig.backward_signature else {}
    roles: list[tuple] = []
    for i, name in enumerate(out_names):
        if i < n_mut:
            roles.append(("buffer", sig.buffers_to_mutate[name][strip:]))
        elif i < n_mut + n_user:
            roles.append(("loss",) if mode == "train" else ("output", i - n_mut))
        else:
            roles.append(("grad", grads[name][strip:]))
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    for n in param_names + buffer_names:
        key = id(named[n]) if n in named else None
        if key in first:
            tied[n] = first[key]
        elif key is not None:
            first[key] = n
    return Captured(
        gm=gm, tied=tied, mode=mode, param_names=param_names, buffer_names=buffer_names,
        input_meta=[(tuple(x.shape), x.dtype) for x in inputs], output_roles=roles,
        out_spec=step.out_spec, no_grad_params=no_grad,
        seconds=time.perf_counter() - t0)
