"""overhead: magis_nb's generated program against PyTorch, before any rewrite.

The unoptimized program (captured, re-ordered as PyTorch ran it, no plan) and
eager PyTorch's step alternate (`timing.time_steps`): the median per-pair time
ratio and its quartiles. Then a few steps of each under `torch.profiler`, and
the ops whose self time differs most, by op and input shapes (ms and calls per
step). With --compiled, both sides are compiled by inductor first: the program
as `magis+inductor` compiles a plan (`peers_compile.compile_plan`), PyTorch's
step by `torch.compile`; "inductor kernels" is then the self time of inductor's
generated kernels (kernel profiling on), and --no-conv-share leaves out
`peers_compile.share_conv_inputs` (each convolution copies its own inputs).

With --by-op (not with --compiled), the op table comes from a wall clock
around every ATen call instead (`clock_ops`, a TorchDispatchMode below autograd,
the same on both sides). The profiler's per-event cost grows with its events,
and eager has many more (autograd's nodes): it put eager BERT's op self time
above its wall time. The clock is what found the program's slow dropout mask
multiply (magis_nb/kernels.py, Note [applying a dropout mask]).

This is what a plan's measured time adds to its simulated one: the simulator
prices the program as its ops timed alone.
"""
from __future__ import annotations

import copy
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import zoo
from ..capture import eager_step
from ..program import trace
from ..timing import clear_grads, time_steps
from .common import fixed_threads, parser, table, write_json


def profile_ops(fn, steps: int = 3) -> dict[tuple[str, str], tuple[float, int]]:
    """(op, input shapes) -> (self ms per step, calls per step) over ``steps`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            fn()
    return {(e.key, str(e.input_shapes)): (e.self_cpu_time_total / 1e3 / steps, e.count // steps)
            for e in prof.key_averages(group_by_input_shape=True)}


class _OpClock(TorchDispatchMode):
    """Wall seconds and calls of every ATen call, by (op, input shapes)."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        shapes = str([list(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
        key = (str(func), shapes)
        self.seconds[key] += dt
        self.calls[key] += 1
        return out


def clock_ops(fn, steps: int = 5) -> dict[tuple[str, str], tuple[float, int]]:
    """(op, input shapes) -> (ms per step, calls per step) over ``steps`` calls of
    ``fn``, each ATen call timed by the wall clock (after one untimed call)."""
    fn()
    clock = _OpClock()
    with clock:
        for _ in range(steps):
            fn()
    return {k: (clock.seconds[k] * 1e3 / steps, clock.calls[k] // steps) for k in clock.seconds}


def _kernels_ms(ops) -> float:
    return sum(ms for (key, _), (ms, _) in ops.items() if "cpp_fused" in key)


def run(name: str, size: str, reps: int, compiled: bool, top: int, share_conv: bool = True,
        by_op: bool = False) -> dict:
    if by_op and compiled:
        raise ValueError("--by-op times ATen calls; a compiled step runs inductor's kernels")
    case = zoo.build(name, size)
    prog = trace(case.model, case.inputs, loss_fn=case.loss_fn).module()  # PyTorch's order
    ref_model = copy.deepcopy(case.model)
    if compiled:
        import torch._inductor.config as iconfig

        from .peers_compile import compile_plan
        from ..capture import LossModule

        iconfig.fallback_random = True          # eager's dropout masks on both sides
        iconfig.cpp.enable_kernel_profile = True
        prog = compile_plan(prog, share_conv=share_conv)
        fn = torch.compile(LossModule(ref_model, case.loss_fn))

        def ref():
            loss = fn(*case.inputs)[0]
            loss.backward()
    else:
        def ref():
            eager_step(ref_model, case.inputs, case.loss_fn, "train")

    def step():
        prog.step(*case.inputs)

    t = time_steps(step, reps, before=clear_grads(case.model.parameters()),
                   ref=ref, ref_before=clear_grads(ref_model.parameters()))
    ops = clock_ops if by_op else profile_ops
    ours, theirs = ops(step), ops(ref)
    keys = sorted(set(ours) | set(theirs),
                  key=lambda k: -abs(ours.get(k, (0.0, 0))[0] - theirs.get(k, (0.0, 0))[0]))
    rows = []
    for k in keys[:top]:
        (a, na), (b, nb) = ours.get(k, (0.0, 0)), theirs.get(k, (0.0, 0))
        rows.append({"op": k[0], "shapes": k[1], "program_ms": round(a, 2), "program_calls": na,
                     "pytorch_ms": round(b, 2), "pytorch_calls": nb})
    q1, q3 = t.quartiles
    out = {"model": name, "size": size, "compiled": compiled, "share_conv": share_conv,
           "op_times": "wall clock per ATen call" if by_op else "profiler self time",
           "time_ratio": round(t.ratio, 4),
           "time_ratio_q1": round(q1, 4), "time_ratio_q3": round(q3, 4),
           "program_s": round(t.step_s, 4), "pytorch_s": round(t.ref_s, 4),
           "program_self_ms": round(sum(v[0] for v in ours.values()), 1),
           "pytorch_self_ms": round(sum(v[0] for v in theirs.values()), 1), "ops": rows}
    if compiled:
        out["program_kernels_ms"] = round(_kernels_ms(ours), 1)
        out["pytorch_kernels_ms"] = round(_kernels_ms(theirs), 1)
    return out


def main(argv) -> int:
    p = parser("overhead", __doc__)
    p.add_argument("--models", default="bert", help="zoo models, comma-separated")
    p.add_argument("--size", default="tiny", help="zoo config (default: tiny)")
    p.add_argument("--reps", type=int, default=15, help="timed pairs (program, PyTorch)")
    p.add_argument("--compiled", action="store_true", help="compile both sides with inductor")
    p.add_argument("--no-conv-share", action="store_true",
                   help="with --compiled: without peers_compile.share_conv_inputs")
    p.add_argument("--top", type=int, default=12, help="ops listed, by self-time difference")
    p.add_argument("--by-op", action="store_true",
                   help="op times by a wall clock around each ATen call (clock_ops), not the profiler")
    a = p.parse_args(argv)
    if a.by_op and a.compiled:
        p.error("--by-op times ATen calls: not with --compiled")
    fixed_threads()
    out = []
    for name in a.models.split(","):
        r = run(name, a.size, a.reps, a.compiled, a.top, share_conv=not a.no_conv_share, by_op=a.by_op)
        out.append(r)
        extra = (f"; inductor kernels {r['program_kernels_ms']} ms against {r['pytorch_kernels_ms']} ms"
                 if a.compiled else "")
        print(f"{name} ({a.size}{', compiled' if a.compiled else ''}): program / PyTorch "
              f"x{r['time_ratio']} (q1-q3 {r['time_ratio_q1']}-{r['time_ratio_q3']}); "
              f"{'ATen calls (wall clock)' if a.by_op else 'self time'} per "
              f"step {r['program_self_ms']} ms against {r['pytorch_self_ms']} ms{extra}")
        print(table(r["ops"], [("op", "op"), ("shapes", "input shapes"), ("program_ms", "program ms"),
                               ("program_calls", "calls"), ("pytorch_ms", "PyTorch ms"),
                               ("pytorch_calls", "calls")]), flush=True)
    write_json(a.json, out)
    return 0
