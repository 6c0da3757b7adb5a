"""Specializing a forward's data-dependent scalars on the example inputs.

Note [specialized scalars]
Models branch on tensor values: HF's causal-mask helpers skip the mask when
``padding_mask.all()``, others read ``.item()`` for a loop bound. FakeTensors
have no values, so the export fails with a data-dependent error. Since a plan is
specialized on the example's shapes anyway, we specialize on its values too, as
``torch.export`` does for a concrete example: one eager forward (no backward,
model and RNG state put back) records every ``aten._local_scalar_dense`` result
in call order, and the export replays them in the same order (every trace of
the forward makes the same calls, since it takes the same branches). The
captured graph keeps each ``_local_scalar_dense`` node with the value it had;
the generated program re-reads the value and raises if it differs
(`runtime.codegen`), so a batch that would take another branch is refused,
never computed along the wrong one.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import traceback
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..snapshot import ModelSnapshot, forked_rng
from .switches import config_switches, module_switches, outside, user_frames

aten = torch.ops.aten
SCALAR_OPS = (aten._local_scalar_dense.default, aten.item.default)


class SpecializationError(ValueError):
    """A batch would take another branch than the example the plan was made for."""


# The program's guard: the value a specialized scalar must have again.
_lib = torch.library.Library("magis_nb", "FRAGMENT")
_lib.define("expect_scalar(Tensor x, Scalar expected, str where) -> ()")


def _expect(x, expected, where):
    got = x.item()
    if got != expected:
        raise SpecializationError(
            f"this plan was made for inputs where {where} read {expected!r}; these inputs "
            f"give {got!r} (a different branch of forward()): optimize again with "
            "example inputs like these (Note [specialized scalars])")


def _expect_meta(x, expected, where):
    return None


_lib.impl("expect_scalar", _expect, "CompositeExplicitAutograd")
_lib.impl("expect_scalar", _expect_meta, "Meta")
EXPECT = torch.ops.magis_nb.expect_scalar.default


def _caller() -> str:
    """The innermost frame outside torch and magis_nb: the line that read the value."""
    for fs in reversed(traceback.extract_stack()):
        if outside(fs.filename):
            return f"{os.path.basename(fs.filename)}:{fs.lineno} ({(fs.line or '').strip()})"
    return "forward()"


class RandomBranchError(ValueError):
    """forward() branches on a value drawn at random (Note [a branch on a random draw])."""


# Note [a branch on a random draw]
# HF's layerdrop draws ``torch.rand([])`` and skips the layer when it falls under
# p. Specialized like any value, the plan holds the example's draw, and a later
# step draws another one: in a training loop 5 of 8 later seeds raised
# SpecializationError at step k, a crash capture could have seen. A plan is one
# pattern of branches (planning each of 2^layers patterns is no plan), and
# running the other patterns eagerly would take eager's memory on nearly every
# step. So the recording pass follows what random ops made (every tensor
# computed from a random op's output, views and in-place writes included) and
# refuses the capture when a specialized value is one of them, naming the line
# and the switch that turns the draw off.
_RANDOM = {getattr(aten, n) for n in (
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "bernoulli", "bernoulli_", "uniform_", "normal", "normal_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "random_", "multinomial", "poisson",
    "native_dropout", "_standard_gamma") if hasattr(aten, n)}


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.values: list = []
        self.random: list[tuple[str, str]] = []    # (where, random op) of a random branch
        self.frames: list[tuple] = []              # `user_frames` of the first random branch
        # id(tensor) -> (a weak reference to it, the random op it comes from)
        self._drawn: dict[int, tuple[weakref.ref, str]] = {}

    def _from_random(self, t) -> str | None:
        got = self._drawn.get(id(t))
        return got[1] if got is not None and got[0]() is t else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        source = (f"aten.{func.overloadpacket.__name__} (drawn at {_caller()})"
                  if func.overloadpacket in _RANDOM else
                  next((o for o in map(self._from_random, ins) if o is not None), None))
        if func in SCALAR_OPS:
            where = _caller()
            self.values.append((out, where))
            if source is not None:
                self.random.append((where, source))
                if not self.frames:
                    self.frames = user_frames()
        elif source is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._drawn[id(t)] = (weakref.ref(t), source)
        return out


def _random_branch(model: torch.nn.Module, random: list[tuple[str, str]],
                   frames: list[tuple]) -> RandomBranchError:
    where, op = random[0]
    # the module attributes (Bart's copies of its config's layerdrop), else the
    # config entries read where it branches (Wav2Vec2 reads config.layerdrop)
    switch = module_switches(model) or config_switches(model, frames)
    how = (f"set {' and '.join(switch)} before optimizing" if switch else
           "turn that draw off for training (for an HF model with layerdrop: "
           "layerdrop=0.0 in its config)")
    more = f" ({len(random) - 1} more such branch(es))" if len(random) > 1 else ""
    return RandomBranchError(
        f"forward() branches on a random draw: {where} reads a value computed from "
        f"{op}{more}. A plan is made for one branch of forward(), and a later step "
        f"draws another, so the step cannot be planned; {how} "
        "(Note [a branch on a random draw])")


def record_scalars(run: Callable[[], object], model: torch.nn.Module, grad: bool) -> list:
    """The scalars ``run()`` (one eager forward) reads off tensors, in order, each
    with the source line that read it.

    The model's buffers (BatchNorm running statistics) and the global RNG come
    back as they were: recording must not change the user's training. ``grad``:
    run with autograd on, as the export of a training step does (a forward may
    branch on ``torch.is_grad_enabled()``). A value computed from a random draw
    raises RandomBranchError (Note [a branch on a random draw])."""
    buffers = ModelSnapshot.buffers_of(model)
    rec = _Recorder()
    try:
        with forked_rng(), torch.set_grad_enabled(grad), rec:
            run()
    finally:
        buffers.restore()
    if rec.random:
        raise _random_branch(model, rec.random, rec.frames)
    return rec.values


@contextlib.contextmanager
def replay_scalars(values: list):
    """While active, FakeTensors answer ``_local_scalar_dense`` with ``values``,
    cyclically (the export traces the forward more than once)."""
    from torch._subclasses import fake_impls

    table = fake_impls.op_implementations_dict
    old = {op: table.get(op) for op in SCALAR_OPS}
    pos = [0]

    def impl(fake_mode, func, arg):
        if not values:
            raise RuntimeError("no recorded value to specialize on")
        v = values[pos[0] % len(values)][0]
        pos[0] += 1
        return v

    # Kept through the export's dead-code elimination: the program re-checks them.
    impure = torch.fx.node._side_effectful_functions
    added = [op for op in SCALAR_OPS if op not in impure]
    # The joint is re-traced by running the first graph on the example's real
    # tensors; there the value can be read for real instead of refused.
    aot = importlib.import_module("torch._functorch.aot_autograd")
    make_fx = getattr(aot, "make_fx", None)
    try:
        for op in SCALAR_OPS:
            table[op] = impl
        impure.update(added)
        if make_fx is not None:
            aot.make_fx = functools.partial(make_fx, _error_on_data_dependent_ops=False)
        yield
    finally:
        if make_fx is not None:
            aot.make_fx = make_fx
        impure.difference_update(added)
        for op, fn in old.items():
            if fn is None:
                table.pop(op, None)
            else:
                table[op] = fn


def is_data_dependent(exc: BaseException) -> bool:
    text, name = str(exc), type(exc).__name__
    return ("data-dependent" in text or "DataDependent" in name
            or "GuardOnDataDependent" in name or "Could not guard on data-dependent" in text)
