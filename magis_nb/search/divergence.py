"""Where a plan's program first departs from the unoptimized one.

A plan that differs from eager is a bug report; its most useful line is the op
that diverged. Both programs are generated from graphs whose rewrites keep the
names of the values they leave alone (a recomputed copy is ``relu_re``, a loaded
one ``relu_load``, a split region's parts ``relu_p0``..., its assembled output
``relu`` again), so running both once with every assignment recorded and
comparing the values that share a name, in the plan's order, finds the first
value that is not the same.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from ..runtime.codegen import compile_source

_ASSIGN = re.compile(r"^(\s+)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*,?\s*=\s")
CAP_BYTES = 1 << 30          # values kept per run: beyond this, the search stops recording


def recorded_values(module, run: Callable[[], object], keep: Callable = None
                    ) -> tuple[dict[str, object], dict[str, str]]:
    """``keep(t)`` (default: a clone) of every tensor the module's program assigns
    (its last value in a loop) while ``run()`` calls the module once; and each
    name's generated line."""
    keep = keep or (lambda v: v.detach().clone())
    seen: dict[str, object] = {}
    where: dict[str, str] = {}
    total = [0]

    def rec(names, vals):
        for nm, v in zip(names, vals):
            if isinstance(v, torch.Tensor) and total[0] < CAP_BYTES:
                seen[nm] = keep(v)
                total[0] += v.numel() * v.element_size()

    lines = []
    for line in module.code.splitlines():
        lines.append(line)
        m = _ASSIGN.match(line)
        if m and not line.lstrip().startswith(("for ", "if ", "def ")):
            names = [s.strip() for s in m.group(2).split(",") if s.strip()]
            for nm in names:
                where.setdefault(nm, line.strip())
            lines.append(f"{m.group(1)}_rec({names!r}, ({', '.join(names)},))")
    fn = compile_source("\n".join(lines) + "\n")
    fn.__globals__["_rec"] = rec
    orig = module.step_fn
    module.step_fn = fn
    try:
        run()
    finally:
        module.step_fn = orig
    return seen, where


def first_divergence(before, plan, run: Callable[[object], object], *, rtol: float,
                     rel_atol: float) -> str | None:
    """The first value of ``plan``'s program (in its order) that differs from the
    value of the same name in ``before``'s: "name: generated line (max abs err)".
    ``run(module)`` runs one step from the same state and seed each time."""
    want, _ = recorded_values(before, lambda: run(before))
    got, where = recorded_values(plan, lambda: run(plan))
    for nm, b in got.items():
        a = want.get(nm)
        if a is None or a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
            continue
        a32, b32 = a.float(), b.float()
        tol = rel_atol * a32.abs().max().item() if a32.numel() else 0.0
        if not torch.allclose(b32, a32, rtol=rtol, atol=tol, equal_nan=True):
            err = (b32 - a32).abs().max().item()
            return f"{nm}: {where.get(nm, '?')} (max abs err {err:.3g})"
    return None
