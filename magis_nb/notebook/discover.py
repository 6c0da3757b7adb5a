"""Find the model, its example inputs and the loss that a ``%%magis`` cell defined.

Rules (flags override each one):
- model: an `nn.Module` with parameters that the cell bound; modules nested in
  another candidate are parts of it, not candidates. If the cell bound none, any
  such module in the namespace. Several -> ask for ``--model``.
- inputs: a dict batch the cell bound (one, and no loss: ``model(**batch)``
  computes its own, HF style); else tensors the cell bound. Names matching
  ``forward``'s parameters win; otherwise the tensors in the order the cell bound
  them, if their number fits ``forward`` (plus the target when there is a loss).
- loss: a loss module (``nn.CrossEntropyLoss()``...) or a callable named
  ``loss_fn``/``criterion`` that the cell bound. None: the model returns its loss.
"""
from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from IPython.core.error import UsageError

LOSS_NAMES = ("loss_fn", "criterion", "loss_func", "loss_function")
TARGET_NAMES = ("y", "target", "targets", "label", "labels")


@dataclass
class Found:
    model_name: str
    model: nn.Module
    input_names: list[str]
    inputs: tuple | Mapping         # positional inputs, or a dict batch (keyword arguments)
    loss_name: str | None
    loss_fn: Any


def assigned_names(source: str) -> list[str]:
    """Names a cell binds at top level, in the order of their last binding."""
    order: dict[str, None] = {}

    def bind(name: str):
        order.pop(name, None)
        order[name] = None

    def targets(t):
        if isinstance(t, ast.Name):
            bind(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e)
        elif isinstance(t, ast.Starred):
            targets(t.value)

    def visit(stmts):
        for s in stmts:
            for node in ast.walk(s):  # walrus: bound while the statement evaluates
                if isinstance(node, ast.NamedExpr):
                    targets(node.target)
            if isinstance(s, ast.Assign):
                for t in s.targets:
                    targets(t)
            elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
                targets(s.target)
            elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(s.name)
            elif isinstance(s, (ast.For, ast.AsyncFor)):
                targets(s.target)
                visit(s.body + s.orelse)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        targets(item.optional_vars)
                visit(s.body)
            elif isinstance(s, (ast.If, ast.While)):
                visit(s.body + s.orelse)
            elif isinstance(s, ast.Try):
                visit(s.body + s.orelse + s.finalbody)
                for h in s.handlers:
                    visit(h.body)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                for a in s.names:
                    bind((a.asname or a.name).split(".")[0])

    visit(ast.parse(source).body)
    return list(order)


def _is_model(obj) -> bool:
    from ..runtime.module import OptimizedModule
    return (isinstance(obj, nn.Module) and not isinstance(obj, OptimizedModule)
            and any(True for _ in obj.parameters()))


def _is_loss(name: str, obj) -> bool:
    if isinstance(obj, nn.modules.loss._Loss):
        return True
    return name in LOSS_NAMES and callable(obj)


def _get(ns: dict, flag: str, name: str):
    if name not in ns:
        raise UsageError(f"{flag} {name}: no variable named {name!r} in the namespace")
    return ns[name]


def find_model(ns: dict, bound: list[str], name: str | None) -> tuple[str, nn.Module]:
    if name is not None:
        obj = _get(ns, "--model", name)
        if not isinstance(obj, nn.Module):
            raise UsageError(f"--model {name}: {name} is a {type(obj).__name__}, "
                             "not a torch.nn.Module")
        return name, obj
    pool = [n for n in bound if n in ns and _is_model(ns[n])]
    where = "the cell defined"
    if not pool:
        pool = [n for n in ns if not n.startswith("_") and _is_model(ns[n])]
        where = "the namespace holds"
    # A block the cell built and then put into the model is part of it.
    inner = {id(m) for n in pool for m in list(ns[n].modules())[1:]}
    pool = [n for n in pool if id(ns[n]) not in inner]
    # the same module under two names is one model
    seen: dict[int, str] = {}
    for n in pool:
        seen.setdefault(id(ns[n]), n)
    pool = list(seen.values())
    if not pool:
        raise UsageError("%%magis found no model: define an nn.Module with parameters "
                         "in the cell (model = MyNet(...)) or pass --model NAME")
    if len(pool) > 1:
        raise UsageError(f"%%magis found several candidate models ({', '.join(pool)}) "
                         f"that {where}; pick one with --model NAME")
    return pool[0], ns[pool[0]]


def find_loss(ns: dict, bound: list[str], name: str | None, mode: str):
    if mode == "infer":
        if name is not None:
            raise UsageError("--loss makes no sense with --mode infer (no loss is computed)")
        return None, None
    if name is not None:
        obj = _get(ns, "--loss", name)
        if not callable(obj):
            raise UsageError(f"--loss {name}: {name} is not callable")
        return name, obj
    pool = [n for n in bound if n in ns and _is_loss(n, ns[n])]
    if len(pool) > 1:
        raise UsageError(f"%%magis found several loss functions ({', '.join(pool)}); "
                         "pick one with --loss NAME")
    return (pool[0], ns[pool[0]]) if pool else (None, None)


def _forward_arity(model: nn.Module) -> tuple[list[str], int, float]:
    """forward's positional parameter names, how many are required, and the most it takes."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return [], 0, float("inf")
    names, required, most = [], 0, 0.0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            most = float("inf")
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
            most += 1
            required += p.default is p.empty
    return names, required, most


def _is_batch(obj) -> bool:
    """A dict batch (``model(**batch)``): string keys, some tensor values."""
    return (isinstance(obj, Mapping) and bool(obj) and all(isinstance(k, str) for k in obj)
            and any(isinstance(v, torch.Tensor) for v in obj.values()))


def _expand(names: list[str], ns: dict, flag: str) -> tuple[list[str], tuple | Mapping]:
    values = [_get(ns, flag, n) for n in names]
    if len(values) == 1 and isinstance(values[0], (tuple, list)):
        return names, tuple(values[0])          # --inputs batch, where batch = (x, y)
    if len(values) == 1 and _is_batch(values[0]):
        return names, values[0]                 # --inputs batch, where batch = {"input_ids": ...}
    return names, tuple(values)


def find_inputs(ns: dict, bound: list[str], names: list[str] | None, model: nn.Module,
                model_name: str, has_loss: bool, mode: str) -> tuple[list[str], tuple]:
    if names is not None:
        return _expand(names, ns, "--inputs")
    # A model that computes its own loss from a dict batch (HF: labels=...): the
    # one batch the cell bound is the call, model(**batch).
    batches = [n for n in bound if n in ns and _is_batch(ns[n])]
    if len(batches) == 1 and not (has_loss and mode == "train"):
        return batches, ns[batches[0]]
    tensors = [n for n in bound if n in ns and isinstance(ns[n], torch.Tensor)]
    params, required, most = _forward_arity(model)
    extra = 1 if (has_loss and mode == "train") else 0   # the target for loss_fn
    hint = "pass --inputs a,b (model inputs in order" + (", then the target)" if extra else ")")
    if not tensors:
        raise UsageError(f"%%magis found no example input tensors in the cell for "
                         f"{model_name}; define them in the cell (x = torch.randn(...)) or "
                         f"{hint}")
    # forward(idx, targets=None) and a cell that defines idx and targets: use the names.
    named = []
    for p in params:
        if p not in tensors:
            break
        named.append(p)
    if len(named) >= max(required, 1):
        if extra:
            rest = [t for t in tensors if t not in named]
            target = [t for t in rest if t in TARGET_NAMES] or rest[-1:]
            if not target:
                raise UsageError(f"%%magis found no target tensor for the loss; {hint}")
            named.append(target[0])
        return named, tuple(ns[n] for n in named)
    lo, hi = required + extra, most + extra
    if lo <= len(tensors) <= hi:
        return tensors, tuple(ns[n] for n in tensors)
    want = f"{lo}" if lo == hi else f"{lo} to {hi}" if hi != float("inf") else f"{lo} or more"
    raise UsageError(f"%%magis found tensors {', '.join(tensors)} but {model_name} takes "
                     f"{want} (forward{tuple(params)}"
                     + (" plus the loss target" if extra else "") + f"); {hint}")


def discover(ns: dict, source: str, flags) -> Found:
    bound = assigned_names(source)
    model_name, model = find_model(ns, bound, flags.model)
    loss_name, loss_fn = find_loss(ns, bound, flags.loss, flags.mode)
    input_names, inputs = find_inputs(ns, bound, flags.inputs, model, model_name,
                                      loss_fn is not None, flags.mode)
    return Found(model_name, model, input_names, inputs, loss_name, loss_fn)
