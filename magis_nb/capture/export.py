"""nn.Module + example inputs + loss -> ATen graph (joint training step or forward).

The graph is traced on FakeTensors by ``aot_export_module``: shapes and dtypes are
known for every node, and no activation is ever allocated, so paper-sized models
(built on the meta device) capture in seconds.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from ..snapshot import forked_rng
from .batch import CallSpec, split_call
from .checkpoint import marked_checkpoints, region_tags
from .ctc import traceable_ctc
from .host_random import refusal, watched
from .messages import explain, user_frame
from .outputs import find_loss, flatten, locate_loss
from .specialize import RandomBranchError, is_data_dependent, record_scalars, replay_scalars
from .upstream import fixed_decompositions, replayed_as_recorded


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
    # Tied weights: every further name of a shared parameter -> its first name. The
    # graph has one placeholder per distinct tensor (Note [one placeholder per parameter]).
    tied: dict[str, str] = field(default_factory=dict)
    call: CallSpec | None = None            # how the model is called (tensors are the inputs)
    # Tensors the export lifted out of forward (``torch.tensor(...)``, masks):
    # get_attr targets -> values; inputs of the program after the user's.
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    # Scalars read off tensors, specialized on the example (Note [specialized scalars]).
    specialized: list = field(default_factory=list)
    seconds: float = 0.0
    # Bytes of the storage behind each placeholder's real tensor, in placeholder
    # order: a buffer can be a view of a larger storage (``torch.hann_window``
    # computes N + 1 points and keeps N), which its fake tensor does not show.
    input_storage: list[int] = field(default_factory=list)
    # The user's torch.utils.checkpoint regions (Note [the user's checkpoint
    # regions] in capture/checkpoint.py): forward op name in ``gm`` -> region
    # number; the same for the ops of their backward; the regions the user ran
    # reentrant
    checkpoint: dict[str, int] = field(default_factory=dict)
    checkpoint_backward: dict[str, int] = field(default_factory=dict)
    checkpoint_reentrant: tuple = ()
    # Training without loss_fn: where in the model's output the loss was
    # (``out[1]`` of nanoGPT's ``(logits, loss)``, ``out.loss``); None where the
    # model returned the loss itself (`outputs.locate_loss`)
    loss_at: str | None = None

    @property
    def n_inputs(self) -> int:
        return len(self.input_meta)


class _Step(nn.Module):
    """Wraps the user's model so that the traced function takes tensors and returns
    a flat tuple.

    Note [one placeholder per parameter]
    The model is not a submodule: the step registers each *distinct* parameter and
    buffer once (``p0``, ``b0``, ...) and calls the model through
    ``functional_call(..., tie_weights=True)``. A weight tied under two names
    (embeddings and LM head; HF's ``cls.predictions.bias`` and
    ``cls.predictions.decoder.bias``) is then one graph input with one gradient,
    summed over its uses, whichever of its names the forward reads. Registering the
    model itself would give every name its own placeholder, and a name the forward
    never reads (the HF BERT bias above) fails the export: "Found a parameter that
    did not receive a gradient".
    """

    def __init__(self, model: nn.Module, loss_fn: Callable | None, mode: str, call: CallSpec):
        super().__init__()
        object.__setattr__(self, "model", model)
        # Not registered as a submodule: a loss module's buffers are not the model's.
        object.__setattr__(self, "_loss_fn", loss_fn)
        object.__setattr__(self, "_mode", mode)
        object.__setattr__(self, "call", call)
        object.__setattr__(self, "out_spec", None)
        object.__setattr__(self, "loss_at", None)    # where in the output the loss was
        self.param_names = [n for n, _ in model.named_parameters()]
        self.buffer_names = [n for n, _ in model.named_buffers()]
        for i, (_, p) in enumerate(model.named_parameters()):
            self.register_parameter(f"p{i}", p)
        for i, (_, b) in enumerate(model.named_buffers()):
            self.register_buffer(f"b{i}", b)
        # Note [plain tensor attributes]
        for name, t in plain_tensors(model):
            self.register_buffer(f"b{len(self.buffer_names)}", t)
            self.buffer_names.append(name)

    def state(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by their names in the model, as the
        step currently holds them (reparametrized while the export traces)."""
        st = {n: getattr(self, f"p{i}") for i, n in enumerate(self.param_names)}
        st.update({n: getattr(self, f"b{i}") for i, n in enumerate(self.buffer_names)})
        return st

    def forward(self, *tensors):
        args, kwargs = self.call.rebuild(tensors)

        def model(*a, **k):     # the model with the step's (traced) parameters and buffers
            return torch.func.functional_call(self.model, self.state(), a, k,
                                              tie_weights=True, strict=False)

        if self._mode == "train" and self._loss_fn is None:
            try:
                out, where = locate_loss(model(*args, **kwargs))
            except TypeError as e:
                raise CaptureError(str(e)) from None
            object.__setattr__(self, "loss_at", where)
        else:
            out = _called(model, args, kwargs, self._loss_fn, self._mode)
        if self._mode == "infer":
            leaves, spec = flatten(out)
            object.__setattr__(self, "out_spec", spec)
            return tuple(leaves)
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out)
            raise CaptureError(
                f"the loss must be a scalar tensor, got {shape}; reduce it "
                "(e.g. .mean()) in the model or in loss_fn")
        return (out,)


def _called(model: Callable, args: tuple, kwargs: dict, loss_fn: Callable | None, mode: str):
    """``model`` called as capture calls it: its output (infer), ``loss_fn(output,
    last positional argument)``, or the loss the model returns."""
    if mode == "infer":
        return model(*args, **kwargs)
    if loss_fn is not None:
        return loss_fn(model(*args[:-1], **kwargs), args[-1])
    return find_loss(model(*args, **kwargs))


def call_step(model: nn.Module, inputs, loss_fn: Callable | None = None,
              mode: str = "train"):
    """The model called as capture calls it: the loss (train) or the output (infer)."""
    args, kwargs = split_call(inputs)
    return _called(model, args, kwargs, loss_fn, mode)


class LossModule(nn.Module):
    """``model`` (a submodule) and ``loss_fn`` as one module whose ``forward(*inputs)``
    returns ``(loss,)``, the model called as capture calls it: for peers that
    compile the whole step (``torch.compile(LossModule(model, loss_fn))``)."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None = None):
        super().__init__()
        self.model = model
        object.__setattr__(self, "loss_fn", loss_fn)   # a loss module's buffers are not the model's

    def forward(self, *inputs):
        return (call_step(self.model, inputs, self.loss_fn),)


def eager_step(model: nn.Module, inputs, loss_fn: Callable | None = None,
               mode: str = "train"):
    """Run one step eagerly with capture's calling convention (the reference).

    Training: forward, loss, ``loss.backward()``; returns the detached loss.
    Inference: returns the model's output.
    """
    if mode == "infer":
        with torch.no_grad():
            return call_step(model, inputs, mode="infer")
    loss = call_step(model, inputs, loss_fn)
    loss.backward()
    return loss.detach()


def _call_spec(inputs, loss_fn, mode: str) -> tuple[CallSpec, list[torch.Tensor]]:
    """The call's structure and its tensors; a CaptureError for what can't be a step."""
    try:
        args, kwargs = split_call(inputs)
    except TypeError as e:
        raise CaptureError(str(e)) from None
    call = CallSpec.of(args, kwargs)
    if not call.tensor_at:
        raise CaptureError("no tensor among the example inputs: pass the tensors the "
                           "model is called with (a tensor, a tuple, or a dict batch)")
    if mode == "train" and loss_fn is not None:
        if not args:
            raise CaptureError(
                "with loss_fn the last positional input is the target: pass "
                "(inputs..., target); a dict batch is for a model that computes its "
                "own loss (labels=...), without loss_fn")
        if len(args) < 2 and not kwargs:
            raise CaptureError("with loss_fn the last input is the target: pass (inputs..., target)")
    return call, call.tensors(args, kwargs)


def _unused_params(step: _Step, tensors: list) -> list[str]:
    """Names of trainable params that get no gradient, found on FakeTensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    named = dict(step.named_parameters())
    with mode:
        fparams = {n: mode.from_tensor(p).requires_grad_(p.requires_grad) for n, p in named.items()}
        fbufs = {n: mode.from_tensor(b) for n, b in step.named_buffers()}
        finputs = [mode.from_tensor(x) for x in tensors]
        out = torch.func.functional_call(step, {**fparams, **fbufs}, tuple(finputs))
        want = [n for n, p in fparams.items() if p.requires_grad]
        grads = torch.autograd.grad(out[0], [fparams[n] for n in want], allow_unused=True)
    return [step.param_names[int(n[1:])] for n, g in zip(want, grads) if g is None]


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


@contextlib.contextmanager
def _kept_python_state(model: nn.Module):
    """Note [a trace leaves the modules as they were]
    A forward may keep Python state on its modules: LeViT in eval mode caches
    its attention biases in a dict attribute the first time it runs. Run by the
    trace, that cache holds a FakeTensor, and the user's next eager call fails
    ("Cannot access data pointer of Tensor"). Each module's attributes, and the
    contents of those that are dicts, lists or sets, are put back as they were
    before the capture."""
    saved = []
    for mod in model.modules():
        attrs = dict(vars(mod))
        contents = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list)
                        else set(v)) for k, v in attrs.items() if isinstance(v, (dict, list, set))}
        saved.append((mod, attrs, contents))
    try:
        yield
    finally:
        for mod, attrs, contents in saved:
            now = vars(mod)
            for k in [k for k in now if k not in attrs]:
                del now[k]
            for k, v in attrs.items():
                if now.get(k) is not v:
                    now[k] = v
            for k, c in contents.items():
                if _changed(now[k], c):
                    now[k].clear()
                    (now[k].update if isinstance(c, (dict, set)) else now[k].extend)(c)


def _changed(now, was) -> bool:
    """Whether a container's contents are no longer ``was``'s, by identity (a
    list of tensors compared with == would compare the tensors)."""
    if len(now) != len(was):
        return True
    if isinstance(was, dict):
        return any(k not in now or now[k] is not v for k, v in was.items())
    if isinstance(was, list):
        return any(a is not b for a, b in zip(now, was))
    ids = {id(x) for x in was}
    return any(id(x) not in ids for x in now)


def capture(model: nn.Module, inputs, *, loss_fn: Callable | None = None,
            mode: str = "train") -> Captured:
    """Trace one training step (``mode="train"``) or the forward (``"infer"``).

    ``inputs``: a tensor, a tuple of the model's positional arguments, or a dict of
    its keyword arguments (an HF batch); non-tensor arguments are bound into the
    program as constants. Training: with ``loss_fn`` the last positional input is
    the target, the model gets the others and the loss is ``loss_fn(output,
    target)``; without it the model gets every input and must return its own loss
    (a scalar, ``out["loss"]``, ``out.loss``, or the one scalar of a tuple: `outputs.locate_loss`).
    """
    from torch._functorch.aot_autograd import aot_export_module

    if mode not in ("train", "infer"):
        raise CaptureError(f"mode must be 'train' or 'infer', got {mode!r}")
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected an nn.Module, got {type(model).__name__}")
    model = uncompiled(model)
    if mode == "train":
        _refuse_scripted(model)
    call, tensors = _call_spec(inputs, loss_fn, mode)
    call.named(model, target=mode == "train" and loss_fn is not None)
    step = _Step(model, loss_fn, mode, call)
    t0 = time.perf_counter()
    no_grad: list[str] = []
    scalars: list | None = None

    def replaying():
        return replay_scalars(scalars) if scalars is not None else contextlib.nullcontext()

    def export():
        # each attempt from the model as the user left it: Note [a trace leaves
        # the modules as they were]
        with replaying(), _tracing_flag(), fixed_decompositions(), replayed_as_recorded(), \
                _kept_python_state(model):
            if mode == "infer":
                with torch.no_grad():
                    return aot_export_module(step, list(tensors), trace_joint=False)
            return aot_export_module(step, list(tensors), trace_joint=True, output_loss_index=0)

    # fake_tensor logs every failed meta kernel at ERROR; the CaptureError says it once.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    old_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    frozen = contextlib.ExitStack()     # unused parameters, frozen while the export retries
    frozen.enter_context(_kept_python_state(model))
    # tracing a dropout draws from the real generators (aot_export_module moved the
    # CPU one): the user's streams go on as if nothing had been traced
    frozen.enter_context(forked_rng())
    # Note [the user's checkpoint regions]: around every attempt, and around
    # _unused_params' trace (a reentrant checkpoint's backward refuses autograd.grad)
    marks = frozen.enter_context(marked_checkpoints())
    # Note [CTC with fixed shapes]: the eager recording pass too, so that both
    # read the same scalars in the same order
    frozen.enter_context(traceable_ctc())
    draws = frozen.enter_context(watched())     # Note [a draw the trace cannot see]
    try:
        # At most two retries: once with the parameters that get no gradient frozen,
        # once specialized on the example's values (Note [specialized scalars]).
        for _ in range(3):
            try:
                gm, sig = export()
                break
            except AssertionError as e:
                if "did not receive a gradient" not in str(e) or no_grad:
                    raise
                with replaying():
                    no_grad = _unused_params(step, tensors)
                if not no_grad:
                    raise
                frozen.enter_context(_frozen(model, no_grad))
            except Exception as e:  # noqa: BLE001 - data-dependent: see specialize.py
                if not is_data_dependent(e) or scalars is not None or _on_meta(tensors, model):
                    raise
                scalars = record_scalars(lambda: call_step(model, inputs, loss_fn, mode),
                                         model, grad=mode == "train")
                if not scalars:
                    raise
    except CaptureError as e:
        _refuse_draws(model, draws, e, str(e))
        raise
    except Exception as e:  # noqa: BLE001 - every trace failure becomes a CaptureError
        own = mode == "train" and loss_fn is None
        keys = list(split_call(inputs)[1])
        # a RandomBranchError names its own lines; the traceback's is the read
        # that set off the recording pass, not the branch
        line = None if isinstance(e, RandomBranchError) else user_frame(e)
        err = CaptureError(explain(e, own_loss=own, keys=keys), line)
        _refuse_draws(model, draws, e, str(err) if line or isinstance(e, RandomBranchError) else None)
        raise err from e
    finally:
        fake_log.setLevel(old_level)
        frozen.close()
    _refuse_draws(model, draws)

    checkpoint, checkpoint_bwd, reentrant = region_tags(gm, marks)
    _refuse_sparse(gm)
    _refuse_stale_constants(gm)
    param_names = [step.param_names[int(n[1:])] for n in sig.parameters]
    buffer_names = [step.buffer_names[int(n[1:])] for n in sig.buffers]
    real = [getattr(step, n) for n in list(sig.parameters) + list(sig.buffers)] + list(tensors)
    out_names = [a.name for a in gm.graph.output_node().args[0]]
    # aot_export_module orders outputs: buffer mutations, user outputs, gradients.
    n_mut, n_user = len(sig.buffers_to_mutate), len(sig.user_outputs)
    grads = sig.backward_signature.gradients_to_parameters if sig.backward_signature else {}
    roles: list[tuple] = []
    for i, name in enumerate(out_names):
        if i < n_mut:
            roles.append(("buffer", step.buffer_names[int(sig.buffers_to_mutate[name][1:])]))
        elif i < n_mut + n_user:
            roles.append(("loss",) if mode == "train" else ("output", i - n_mut))
        else:
            roles.append(("grad", step.param_names[int(grads[name][1:])]))
    return Captured(
        gm=gm, tied=_tied_names(model), mode=mode, param_names=param_names,
        buffer_names=buffer_names, call=call,
        input_meta=[(tuple(x.shape), x.dtype) for x in tensors], output_roles=roles,
        out_spec=step.out_spec, no_grad_params=no_grad,
        constants={n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"},
        specialized=list(scalars or []), seconds=time.perf_counter() - t0,
        input_storage=[int(t.untyped_storage().nbytes()) for t in real],
        checkpoint=checkpoint, checkpoint_backward=checkpoint_bwd,
        checkpoint_reentrant=reentrant, loss_at=step.loss_at)


def _refuse_draws(model: nn.Module, draws, cause: BaseException | None = None,
                  also: str | None = None) -> None:
    """Note [a draw the trace cannot see]: a capture that drew outside torch is
    refused, whether the trace went on or failed: the failure may be the draw's
    doing (SpecAugment's time mask fails in the backward, with no line to name).
    ``also``: a failure of its own (it names a line, or a random branch), said
    after the draw."""
    text = refusal(model, draws)
    if text is None:
        return
    if not also:
        raise CaptureError(text, draws.path) from cause
    # the draw's line first: the failure's message ends with its own
    err = CaptureError(f"{text}\n  at {draws.path}\nThe trace also failed: {also}")
    err.source_line = draws.path
    raise err from cause


def _refuse_scripted(model: nn.Module) -> None:
    """A TorchScript submodule runs as one opaque call: the trace cannot swap its
    parameters for its own, so they would get no gradient."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.jit.ScriptModule) and any(
                p.requires_grad for p in mod.parameters()):
            raise CaptureError(
                f"submodule {name or 'model'} is a TorchScript module "
                "(torch.jit.script/trace): its parameters cannot be traced for their "
                "gradients; plan the model with that submodule unscripted (the "
                "nn.Module you passed to torch.jit.script)")


def _refuse_sparse(gm) -> None:
    """A sparse tensor in the step (nn.Embedding(sparse=True)'s gradient) has no
    storage the simulator or the runtime could plan: say so, not a KeyError."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "call_function" and ("sparse" in str(n.target) or (
                isinstance(v, torch.Tensor) and v.layout != torch.strided)):
            raise CaptureError(
                f"the step makes a sparse tensor ({n.target}): nn.Embedding or "
                "nn.EmbeddingBag with sparse=True gives a sparse gradient, and a plan "
                "holds dense tensors only; use sparse=False (a dense gradient: with "
                "torch.optim.SparseAdam, switch to Adam)")


def _refuse_stale_constants(gm) -> None:
    """A constant of the program that is a FakeTensor was made by an earlier
    pass of the trace and kept on a module (Note [a trace leaves the modules as
    they were]): the program would read it, and fail, at every run."""
    from torch._subclasses.fake_tensor import FakeTensor
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), FakeTensor):
            raise CaptureError(
                "forward() reads a tensor it cached on a module while it was being "
                "traced (a dict or attribute filled on first use, as LeViT caches its "
                "attention biases in eval mode): the cached value is the trace's, not a "
                "tensor; plan the step in train mode, or turn the cache off while planning")


def uncompiled(model):
    """The module under a `torch.compile` wrapper (``model._orig_mod``), else
    ``model``: a plan replaces the compiled step, and the wrapper's own trace
    (dynamo's) cannot run inside the capture's."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return model
    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


def plain_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Note [plain tensor attributes]
    A tensor a module holds as a plain attribute (``self.pe = torch.zeros(...)``,
    not a parameter or a registered buffer: VideoMAE's sinusoid position table)
    is read by the forward like a buffer, but the export sees a real tensor among
    its fake ones and fails. The step takes each as one more buffer, named by its
    attribute path; the optimized module reads it off the model at every call
    (`attribute`), as eager does. One that requires grad (made from a parameter
    in ``__init__``) is left alone: eager backpropagates through its old graph
    once, which no program can repeat."""
    seen = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    out = []
    for mname, mod in model.named_modules():
        for k, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and not v.requires_grad and id(v) not in seen:
                seen.add(id(v))
                out.append((f"{mname}.{k}" if mname else k, v))
    return out


def attribute(model: nn.Module, path: str) -> torch.Tensor:
    """The tensor at dotted attribute ``path`` of ``model`` (Note [plain tensor attributes])."""
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def _tracing_flag():
    """``torch.compiler.is_compiling()`` is true while the export traces, as under
    ``torch.export``: model code then takes its traceable path. transformers skips
    its lru caches of index tensors there (BEiT's relative positions: a cached
    tensor made by one trace is a stale FakeTensor in the next, "Unexpected fake
    buffer") and its value-dependent mask shortcuts."""
    import torch.compiler as tc

    old = getattr(tc, "_is_compiling_flag", None)
    if old is None:
        yield
        return
    tc._is_compiling_flag = True
    try:
        yield
    finally:
        tc._is_compiling_flag = old


def _on_meta(tensors, model) -> bool:
    """A paper-size capture on the meta device has no values to specialize on."""
    return any(t.device.type == "meta" for t in tensors) or any(
        p.device.type == "meta" for p in model.parameters())


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Every second name of a parameter or buffer -> its first name."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if id(t) in first:
            tied[n] = first[id(t)]
        else:
            first[id(t)] = n
    return tied
