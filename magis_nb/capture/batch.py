"""How the user calls the model: positional and keyword arguments, tensors or not.

Users pass ``(x, y)`` tuples, HF-style dict batches (``model(**batch)`` with
``input_ids``, ``attention_mask``, ``labels``), and flags or ``None`` among them.
A `CallSpec` flattens such a call into its tensor leaves (the graph's inputs, in
order) and everything else (constants, bound into the program as traced), and
rebuilds the call from tensors later: at capture, at every run of the optimized
module, and for the eager reference.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


_TENSOR = "<tensor>"


def split_call(inputs) -> tuple[tuple, dict]:
    """``inputs`` as the user gave them -> (args, kwargs) of the model's call.

    A tensor is one positional argument; a tuple or list, the positional
    arguments; a mapping (dict, HF ``BatchEncoding``), the keyword arguments."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise TypeError(
        f"example inputs must be a tensor, a tuple of the model's arguments or a dict "
        f"of its keyword arguments, not {type(inputs).__name__}")


def _same(a, b) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - objects whose == is not a bool
        return a is b


@dataclass
class CallSpec:
    """The structure of one call; tensor leaves are its variable part."""
    spec: Any                       # pytree spec of (args, kwargs)
    tensor_at: list[int]            # leaf positions that are tensors
    consts: dict[int, Any]          # leaf position -> constant value
    # names of the positional arguments in messages: the forward's parameters
    # (``use_residual``, not ``arg1``), "target" for the loss's (`named`)
    params: tuple[str, ...] = ()

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "CallSpec":
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        consts = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
        return cls(spec, at, consts)

    def tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensor leaves of a call with this structure; a clear error otherwise."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.spec:
            raise TypeError(
                f"this module was planned for a call like {self.describe()}, got "
                f"{CallSpec.of(args, kwargs).describe()}: optimize again for the new call")
        for i, want in self.consts.items():
            if not _same(leaves[i], want):
                raise ValueError(
                    f"argument {self._where(i)} was {want!r} when the step was planned "
                    f"and is {leaves[i]!r} now: non-tensor arguments are part of the plan; "
                    "optimize again with the new value")
        bad = [i for i in self.tensor_at if not isinstance(leaves[i], torch.Tensor)]
        if bad:
            raise TypeError(f"argument {self._where(bad[0])} must be a tensor, got "
                            f"{type(leaves[bad[0]]).__name__}")
        return [leaves[i] for i in self.tensor_at]

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        """(args, kwargs) with ``tensors`` at the tensor leaves, constants elsewhere."""
        leaves = [None] * (len(self.tensor_at) + len(self.consts))
        for i, t in zip(self.tensor_at, tensors):
            leaves[i] = t
        for i, c in self.consts.items():
            leaves[i] = c
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(args), dict(kwargs)

    def names(self) -> list[str]:
        """A readable name for each tensor leaf: ``input_ids``, ``arg0``, ``arg1[2]``."""
        return [self._where(i) for i in self.tensor_at]

    def named(self, model, target: bool) -> "CallSpec":
        """This call with its positional arguments named after ``model.forward``'s
        parameters (``target``: the last is the loss's target, not the model's)."""
        import inspect

        try:
            sig = inspect.signature(model.forward)
        except (TypeError, ValueError):
            return self
        names = [p.name for p in sig.parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        n_args = len(self._leaf_positions()[0])
        own = n_args - 1 if target else n_args
        params = tuple(names[i] if i < len(names) else f"arg{i}" for i in range(own))
        self.params = params + (("target",) if target else ())
        return self

    def _where(self, leaf: int) -> str:
        paths, _ = pytree.tree_flatten_with_path(self._leaf_positions())
        path = paths[leaf][0]
        top = path[0].idx                      # 0: args, 1: kwargs
        rest = path[1:]
        if top == 0:
            i = rest[0].idx
            head, rest = (self.params[i] if i < len(self.params) else f"arg{i}"), rest[1:]
        else:
            head, rest = str(rest[0].key), rest[1:]
        return head + "".join(pytree.keystr((k,)) for k in rest)

    def _leaf_positions(self):
        """The call's structure with each leaf replaced by its position."""
        n = len(self.tensor_at) + len(self.consts)
        return pytree.tree_unflatten(list(range(n)), self.spec)

    def describe(self) -> str:
        args, kwargs = pytree.tree_unflatten(
            [_TENSOR if i in set(self.tensor_at) else repr(self.consts[i])
             for i in range(len(self.tensor_at) + len(self.consts))], self.spec)
        parts = [str(a) for a in args] + [f"{k}={v}" for k, v in kwargs.items()]
        return f"({', '.join(parts)})".replace(repr(_TENSOR), _TENSOR)
