"""A step's random draws, recorded once and replayed in another step.

Note [the wide step draws eager's masks]
The safety net measures eager's own rounding as the difference between eager's
step and the same step of a wider copy of the model (`verify.Reference.spread`).
That difference must be rounding only. On a GPU it is not for a model that
draws: CUDA's fused dropout draws other masks for another dtype (its vector
width follows the element size), so the "spread" of a dropout model is dropout
noise, twice it passes any plan, and the check checks nothing. So where the
wide step runs on CUDA, eager's float32 step is run once more under
`RecordDraws`, and the wide step under `ReplayDraws`: every draw of the wide
step takes the values the float32 step drew (cast to its dtype), and
``native_dropout`` applies the recorded mask to its own input. A step whose
draws cannot be replayed (another seeded op, or other draws in another order)
raises `NotReplayable`; the wide step then gives no spread, and the plans are
held to the fixed tolerances (stricter, never blind).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

aten = torch.ops.aten

# ops whose outputs are their draws (in place or new): replayed by running the
# op (the right dtype, shape and device; its RNG use is harmless) and writing
# the recorded values over what it drew
_PURE = {"bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
         "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_",
         "geometric_", "cauchy_", "log_normal_", "random_"}


class NotReplayable(RuntimeError):
    pass


def _seeded(func) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


def _detached(out):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)


class RecordDraws(TorchDispatchMode):
    """Records the outputs of every random op, in order (``draws``)."""

    def __init__(self):
        super().__init__()
        self.draws: list[tuple[str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _seeded(func):
            self.draws.append((_name(func), _detached(out)))
        return out


class ReplayDraws(TorchDispatchMode):
    """Gives every random op the values `RecordDraws` recorded, in order."""

    def __init__(self, draws: list[tuple[str, object]]):
        super().__init__()
        self.draws, self.i = draws, 0

    def _next(self, name: str):
        if self.i >= len(self.draws) or self.draws[self.i][0] != name:
            got = self.draws[self.i][0] if self.i < len(self.draws) else "nothing"
            raise NotReplayable(f"draw {self.i} is {name}; the recorded step drew {got}")
        self.i += 1
        return self.draws[self.i - 1][1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _seeded(func):
            return func(*args, **kwargs)
        name = _name(func)
        if name == "native_dropout":
            _, mask = self._next(name)
            x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
            if train is False:
                return func(*args, **kwargs)
            scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
            return x * mask.to(x.dtype) * scale, mask.clone()
        if name not in _PURE:
            raise NotReplayable(f"{name} draws and computes at once: its draws cannot be replayed")
        rec = self._next(name)
        out = func(*args, **kwargs)
        with torch.no_grad():
            out.copy_(rec)
        return out

    def finish(self) -> None:
        """Every recorded draw was replayed."""
        if self.i != len(self.draws):
            raise NotReplayable(f"the recorded step drew {len(self.draws)} times, this one {self.i}")
