"""ModelSnapshot: a model's training state, saved to put back after steps that change it.

A training step writes into the model it runs on: parameters' ``.grad``,
buffers (BatchNorm running statistics), and the RNG (dropout). Whoever runs
steps only to measure or check them (timing plans, holding a plan against
eager PyTorch, recording a forward's scalars) saves that state first and
restores it after each run, so every run starts from the same point and the
user's model is left as it was.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn


def _state(model: nn.Module):
    return model.state_dict(keep_vars=True).items()


def _buffers(model: nn.Module):
    return model.named_buffers()


def _params(model: nn.Module):
    return model.parameters()


class ModelSnapshot:
    """Copies of a model's tensors and, optionally, its parameters' gradients and
    the RNG state, written back by `restore`. Made by `of`, `buffers_of` or
    `of_tensors`.

    ``grads=False``: `restore` sets every ``.grad`` to None (a fresh step).
    ``grads=True``: it puts back (copies of) the gradients as they were.
    ``rng=True``: the CPU RNG state, and every CUDA device's with ``cuda=True``.
    A snapshot of a module is restored by name into the tensors the module holds
    then. A snapshot can be restored any number of times.
    """

    def __init__(self, model, named: Callable[[object], Iterable[tuple[object, torch.Tensor]]],
                 params: Callable[[object], Iterable[torch.Tensor]], *,
                 grads: bool = False, rng: bool = False, cuda: bool = False):
        self.model, self._named, self._params = model, named, params
        self.saved = {k: v.detach().clone() for k, v in named(model)}
        self.grads = ([None if p.grad is None else p.grad.detach().clone() for p in params(model)]
                      if grads else None)
        self.rng = torch.get_rng_state() if rng else None
        self.cuda_rng = torch.cuda.get_rng_state_all() if rng and cuda else None

    @classmethod
    def of(cls, model: nn.Module, **kw) -> ModelSnapshot:
        """``model``'s state dict (parameters, persistent buffers); its parameters' grads."""
        return cls(model, _state, _params, **kw)

    @classmethod
    def buffers_of(cls, model: nn.Module) -> ModelSnapshot:
        """Every buffer of ``model`` (non-persistent ones too); gradients untouched."""
        return cls(model, _buffers, lambda m: ())

    @classmethod
    def of_tensors(cls, tensors: Iterable[torch.Tensor], params: Iterable[torch.Tensor],
                   **kw) -> ModelSnapshot:
        """These tensors (parameters and buffers); the gradients of ``params``."""
        tensors, params = list(tensors), list(params)
        return cls(None, lambda _: enumerate(tensors), lambda _: params, **kw)

    def restore(self, into: nn.Module | None = None) -> None:
        """Write the saved state back; with ``into``, into that model instead (a
        deep copy of the one the snapshot was taken `of`)."""
        model = self.model if into is None else into
        with torch.no_grad():
            for k, t in self._named(model):
                t.copy_(self.saved[k])
        params = list(self._params(model))
        grads = self.grads if self.grads is not None else [None] * len(params)
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        if self.rng is not None:
            torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


# Note [the user's CUDA generator]
# ``torch.random.fork_rng(devices=[])`` puts back the CPU generator only, but
# ``torch.manual_seed`` (which a check runs eager and each plan under) seeds every
# CUDA device too, and a model on a GPU draws its dropout masks there: optimize()
# reseeded the user's CUDA stream. Before CUDA starts, ``manual_seed`` queues its
# CUDA seed for the start (torch.cuda's lazy seed tracker), replacing the user's
# own queued ``torch.manual_seed(1234)``: the seed the user's GPU would have
# started from became the check's. So `forked_rng` forks every started CUDA
# device as well, and before CUDA starts puts the queued seeds back.

@contextlib.contextmanager
def forked_rng():
    """The CPU generator, every started CUDA device's generator and the CUDA
    seed queued for CUDA's start, as they were on entry, put back on exit (Note
    [the user's CUDA generator])."""
    started = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if started else []
    tracker = None if started else getattr(torch.cuda, "_lazy_seed_tracker", None)
    queued = None if tracker is None else {k: (list(v) if isinstance(v, list) else v)
                                           for k, v in vars(tracker).items()}
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        if queued is not None:
            vars(tracker).clear()
            vars(tracker).update(queued)
