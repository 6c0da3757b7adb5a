"""``magis_nb.optimize``: capture a step, search plans under a budget, return them."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..analysis.ftrans import divisors
from ..analysis.spatial import region_rank, tiles_name
from ..capture import CaptureError, uncompiled
from ..distributed import BucketComm
from ..ir.phased_norm import PHASED_TARGETS
from ..program import trace
from ..runtime import OptimizedModule
from ..simulate.cost import make_cost
from ..simulate.memory import simulate_memory
from ..simulate.profiles import profile_names
from .algorithm import search
from .objective import Objective, pareto_add
from .report import peak_ratios
from .result import MeasuredMemory, OptimizeResult, Plan, Progress, Region, Timeline
from .safety import PlanError, SafetyNet
from .data_parallel import agree, choose_cap, data_parallel
from .gcpause import paused_gc
from .measured_choice import choose_measured
from .proposals import split_first
from .space import Space, State
from .transfers import swap_ops
from .user_checkpoint import user_checkpoint_state
from .walltime import StepTimer

DEFAULT_LAT = 1.10        # no budget given: the lowest peak within 10% latency
NEAR = 1.05               # an unmet memory budget: the fastest plan within 5% of the lowest peak
MiB = 2 ** 20


def _cost_model(device_profile, inputs):
    """(cost model, copies overlap compute, label). None: measured on the inputs'
    device; a name or spec for `make_cost`; or a cost model object."""
    if device_profile is None:
        dev = next((x.device for x in tree_leaves(inputs) if isinstance(x, torch.Tensor)),
                   torch.device("cpu"))
        device_profile = "measured:cuda" if dev.type == "cuda" else "measured"
    try:
        cost = make_cost(device_profile)
    except KeyError:
        raise ValueError(f"unknown device profile {device_profile!r}; use one of "
                         f"{', '.join(profile_names())} or 'measured'") from None
    return cost, bool(getattr(cost, "async_copies", False)), getattr(cost, "label", repr(cost))


def _parse_mem(budget, reference: int) -> tuple[float, float]:
    """(bytes, ratio of ``reference``) from a ratio (<= 16) or a byte count."""
    b = float(budget)
    if b <= 0:
        raise ValueError(f"mem_budget must be positive, got {budget!r}")
    if b <= 16:
        return b * reference, b
    return b, b / reference


# Note [the budget's baseline]
# A user asking for ``mem_budget=0.5`` means half of what their training step
# takes today, as they run it: eager PyTorch, with their own checkpointing
# (torch.utils.checkpoint, HF's gradient_checkpointing_enable()). The captured
# program is not that step: capture inlines a checkpoint's recomputation away
# (a Llama with gradient checkpointing: 4.62 MiB captured against the user's
# 1.85 MiB), and a slow path can allocate otherwise (MambaForCausalLM: 10.50
# MiB against 6.21 MiB). So the safety net's eager step runs before the search
# and its measured peak is the baseline: budgets and every ratio the user
# reads are of it (`OptimizeResult.reference_peak`), the captured program's
# ratio beside it where the two differ. No plan whose measured step is above
# eager's is returned as if it were good: such plans leave the front (kept in
# ``res.over_eager``), and when no plan the search found measures at or below
# eager's step the lowest measured is returned with ``met=False`` and a message
# that says to keep eager. Where eager's step is not run (``verify=False``, the
# meta device) the baseline is the captured program, simulated, and the
# message says so.


class _Builder:
    """What the result needs from the search: modules, timelines, re-selection."""

    def __init__(self, model: nn.Module, space: Space, before: State, profile: str,
                 safety: SafetyNet | None = None):
        self.model, self.space, self.before, self.profile = model, space, before, profile
        self.safety = safety
        # Data parallel: modules the search checks and times run one rank alone
        # (LocalComm); the one handed back all_reduces on the group (`data_parallel.agree`).
        self.live = False

    def plan_of(self, st: State) -> Plan:
        sp = self.space
        regions = []
        for cid, n in st.plan:
            c = sp.cands[cid]
            name = tiles_name(c.tiles, region_rank(sp.base, c.ops)) if c.tiles \
                else sp.dg.components[c.comp].name
            regions.append(Region(name, n, len(c.ops),
                                  sp.base.nodes[min(c.ops)].name, c.pack, len(c.recompute),
                                  len(c.prologue)))
        remat = sorted(s.op for b in st.batches if b.kind == "remat" for s in b.specs)
        swaps = sorted(f"{s.producer}" + (f"[{s.out}]" if s.out else "")
                       for b in st.batches if b.kind == "swap" for s in b.specs)
        algebra = sorted([f"merge {'+'.join(s.ops)}" for b in st.batches if b.kind == "merge"
                          for s in b.specs]
                         + [f"{b.kind} {s.op}" + ("" if getattr(s, "forward", True) else " (backward)")
                            for b in st.batches if b.kind in ("sink", "split") for s in b.specs])
        return Plan(st.peak, st.latency, regions, remat, swaps, st, algebra)

    def between(self, lo: Plan, hi: Plan) -> list[Plan]:
        """``hi``'s one fission region at every n strictly between ``lo``'s (1 when
        ``lo`` splits nothing) and ``hi``'s, ``hi``'s rewrites replayed; by
        increasing n. Empty unless both plans split that same region alone.

        The front can hold nothing between two splits of one region: with op
        costs measured on a CPU a smaller split can simulate slower than a larger
        one (small parts run from cache when their ops are timed alone), and the
        smaller is then dominated. Measured, the order is the other way round."""
        a, b = dict(lo.state.plan), dict(hi.state.plan)
        if len(b) != 1:
            return []
        ((cid, n_hi),) = b.items()
        if a and set(a) != {cid}:
            return []
        n_lo = a.get(cid, 1)
        out = []
        for d in divisors(self.space.cands[cid].max_n):
            if n_lo < d < n_hi:
                plan = ((cid, d),)
                g, batches = self.space.build(plan, hi.state.batches)
                out.append(self.plan_of(self.space.evaluate(plan, batches, g)))
        return out

    def measured(self, plan: Plan) -> MeasuredMemory | None:
        """``plan``'s step as the safety net measured it, or None (not run)."""
        got = self.safety.measured.get(id(plan.state)) if self.safety is not None else None
        if got is None:
            return None
        return MeasuredMemory(self.safety.ref.eager_peak, *got)

    def module(self, plan: Plan) -> nn.Module:
        st = plan.state
        cap = self.space.program.captured
        dp = self.space.comm
        if dp is None:
            return OptimizedModule(self.model, cap, *st.runs)
        g, order, _ = self.space.bucketed(*st.runs)
        comm = BucketComm(dp.group) if self.live else None
        return OptimizedModule(self.model, cap, g, order, comm=comm)

    def timeline(self, plan: Plan) -> Timeline:
        st: State = plan.state
        g, order = st.runs
        mg, op_ids, _ = g.memgraph()
        index = {nid: i for i, nid in enumerate(op_ids)}
        tl = simulate_memory(mg, [index[v] for v in order])
        steps = len(order)
        pos = {v: i for i, v in enumerate(order)}
        host = [0] * steps
        stores, loads = swap_ops(g)
        last_load: dict[int, int] = {}
        for ld in loads:
            s = g.nodes[ld].args[0].node
            last_load[s] = max(last_load.get(s, -1), pos[ld])
        for s in stores:
            nb = g.tensor(g.nodes[s].args[1]).nbytes
            for i in range(pos[s], last_load.get(s, steps - 1) + 1):
                host[i] += nb
        spans: dict[int, list[int]] = {}
        for v in order:
            reg = g.nodes[v].region
            if reg:
                sp = spans.setdefault(reg[0], [pos[v], pos[v]])
                sp[0], sp[1] = min(sp[0], pos[v]), max(sp[1], pos[v])
        # region ids follow the plan's order, as plan_of lists them
        labels = {rid: r.label for rid, r in enumerate(plan.fission)}
        regions = [(a, b, labels.get(rid, f"region {rid}")) for rid, (a, b) in sorted(spans.items())]
        cats = {c: v for c, v in tl.by_category.items() if c != "host"}
        return Timeline(cats, host, tl.peak, tl.peak_steps[0] if tl.peak_steps else 0, regions)

    def select(self, res: OptimizeResult, mem_budget=None, lat_budget=None,
               measured: bool = True) -> Plan:
        """`choose` a plan for the budget; with a safety net, only one that passed
        its check against eager (Note in `search.safety`): a plan that fails is
        dropped from the front and recorded in ``res.failed``, and the choice is
        made again. Where the result can time plans (``res.timer``) and
        ``measured``, the choice is then made on measured time (Note [measured
        at the front door] in `search.measured_choice`)."""
        plan = self._select(res, mem_budget, lat_budget)
        if measured and res.timer is not None:
            plan = choose_measured(res, mem_budget, lat_budget, DEFAULT_LAT)
        return plan

    def admissible(self, res: OptimizeResult, plan: Plan) -> bool:
        """``plan`` passes its check against eager and measures at or below
        eager's peak; else it leaves the front (into ``res.failed`` or
        ``res.over_eager``)."""
        if self.rejects(res, plan):
            return False
        over = self.over_eager(res, plan)
        if over is None:
            return True
        if all(p is not plan for p, _ in res.over_eager):
            res.over_eager.append((plan, over))
        res.pareto = [p for p in res.pareto if p is not plan]
        return False

    def _select(self, res: OptimizeResult, mem_budget=None, lat_budget=None) -> Plan:
        if self.live:
            raise RuntimeError("a data-parallel plan runs on every rank alike: choose the "
                               "budget in optimize(..., process_group=...) on every rank")
        while True:
            plan = self.choose(res, mem_budget, lat_budget)
            fail = self.rejection(res, plan)
            if fail is None:
                over = self.over_eager(res, plan)
                if over is None:
                    break
                res.over_eager.append((plan, over))
                # plans simulated no lower would measure no lower: only lower ones are tried
                lower = [p for p in res.pareto if p.peak < plan.peak]
                if not lower:
                    plan = self._lowest_over(res)
                    break
                res.pareto = lower
                continue
            if plan.state is res.before.state:
                raise PlanError(
                    "even the captured program, unoptimized, differs from eager PyTorch "
                    f"({fail}); this is a magis_nb bug: please report it with the "
                    "model (res.failed keeps each plan's code)", res.failed)
            if not res.pareto:
                res.pareto = [res.before]      # the program as captured, unoptimized
        if self.safety is None:
            return plan
        if res.failed:
            res.message += (f" ({len(res.failed)} plan(s) failed the check against eager "
                            "and were dropped: see .failed)")
        res.verified = True
        return plan

    def over_eager(self, res: OptimizeResult, plan: Plan) -> int | None:
        """``plan``'s measured peak when it is above eager's step, else None (not
        measured, or at most eager's: Note [the budget's baseline])."""
        m = self.measured(plan)
        if m is None or m.peak <= m.eager_peak:
            return None
        return m.peak

    def _lowest_over(self, res: OptimizeResult) -> Plan:
        """No plan measured at or below eager's step: the lowest measured, back on
        the front, ``met=False``, and a message that says to keep eager."""
        plan, peak = min(res.over_eager, key=lambda t: (t[1], t[0].latency))
        if plan not in res.pareto:
            res.pareto = sorted(res.pareto + [plan], key=lambda p: (p.peak, p.latency))
        res.plan, res.met = plan, False
        res.message = (f"no plan found measures at or below eager PyTorch's step as you run "
                       f"it ({res.eager_peak / MiB:.2f} MiB): the lowest measured "
                       f"{peak / MiB:.2f} MiB ({peak / res.eager_peak:.2f}x of eager's step); "
                       "keep running the model eagerly, or search longer (time_budget)")
        return plan

    def rejects(self, res: OptimizeResult, plan: Plan) -> bool:
        return self.rejection(res, plan) is not None

    def rejection(self, res: OptimizeResult, plan: Plan):
        """Why the safety net fails ``plan`` (None: it passed, or there is no net).
        A failure is recorded in ``res.failed`` and the plan leaves the front."""
        if self.safety is None:
            return None
        fail = self._check(res, plan)
        if fail is not None:
            if fail not in res.failed:
                res.failed.append(fail)
            res.pareto = [p for p in res.pareto if p is not plan]
        return fail

    def _check(self, res: OptimizeResult, plan: Plan):
        """The safety net's verdict on ``plan`` (run once per plan). The modules it
        builds are dropped again: a module (and its host buffers) is built when it
        is asked for, and until then the process holds what it held before."""
        try:
            return self.safety.check(id(plan.state), plan.applied, lambda: res.module_for(plan),
                                     baseline=lambda: res.module_for(res.before))
        finally:
            res.drop_module(plan)
            res.drop_module(res.before)

    def choose(self, res: OptimizeResult, mem_budget=None, lat_budget=None) -> Plan:
        if mem_budget is not None and lat_budget is not None:
            raise ValueError("give mem_budget or lat_budget, not both")
        before, ref = res.before, res.reference_peak
        if mem_budget is not None:
            limit, ratio = _parse_mem(mem_budget, ref)
            kind = "mem"
        else:
            ratio = DEFAULT_LAT if lat_budget is None else float(lat_budget)
            if ratio <= 0:
                raise ValueError(f"lat_budget must be positive, got {lat_budget!r}")
            limit, kind = ratio * before.latency, "lat"
        front = res.pareto
        if kind == "mem":
            ok = [p for p in front if p.peak <= limit]
            plan = min(ok, key=lambda p: (p.latency, p.peak)) if ok else _near_lowest(front)
        else:
            ok = [p for p in front if p.latency <= limit]
            plan = min(ok, key=lambda p: (p.peak, p.latency)) if ok else min(front, key=lambda p: (p.latency, p.peak))
        res.plan, res.met = plan, bool(ok)
        res.budget_kind = kind if (mem_budget is not None or lat_budget is not None) else None
        res.budget, res.budget_ratio = limit, ratio
        res.message = self.describe(res, plan, kind)
        return plan

    def describe(self, res: OptimizeResult, plan: Plan, kind: str) -> str:
        """The one line for ``plan`` chosen under ``res``'s budget of ``kind``
        ("mem" or "lat"; ``res.met``, ``res.budget`` and ``res.budget_ratio`` set)."""
        before, limit, ratio = res.before, res.budget, res.budget_ratio
        mem = f"peak {plan.peak / MiB:.2f} MiB ({peak_ratios(res, plan.peak)})"
        lat = f"latency x{plan.latency / before.latency:.3f} simulated"
        if kind == "mem":
            what = f"memory budget {limit / MiB:.2f} MiB ({ratio:.2f}x)"
            low = min(res.pareto, key=lambda p: (p.peak, p.latency))
            lowest = (f"{what} NOT met: the lowest peak reached is {low.peak / MiB:.2f} MiB "
                      f"({peak_ratios(res, low.peak)}) at x{low.latency / before.latency:.3f} "
                      "simulated")
            return (f"{what} met: {mem}, {lat}" if res.met else lowest if plan is low
                    else f"{lowest}; chosen within {NEAR - 1:.0%} of it, faster: {mem}, {lat}")
        what = f"simulated latency budget x{ratio:.2f}"
        return (f"{what} met: {mem}, {lat}" if res.met else
                f"{what} NOT met: the fastest plan found has {lat}, {mem}")


def _near_lowest(front: list[Plan]) -> Plan:
    """Under a memory budget no plan meets: the fastest plan within NEAR of the
    lowest peak. The lowest alone can cost any time for a sliver of memory
    (Llama-style at 8x the sequence: 40.8 MiB at x2.02 of the unsplit latency,
    41.9 MiB at x0.87)."""
    low = min(p.peak for p in front)
    return min((p for p in front if p.peak <= NEAR * low), key=lambda p: (p.latency, p.peak))


def _bug(what: str, e: BaseException, hint: bool = False) -> str:
    """The message of an internal failure: what failed, the cause, what to do."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    out = f"{what} failed ({type(e).__name__}: {msg[:300]}): a magis_nb bug, please report it with the model"
    if hint:
        out += ("; optimize(..., fission=False) or algebra=False leaves out the rewrites "
                "most likely to cause it")
    return out


def _should_verify(verify: bool | None, model: nn.Module, inputs, peak: int) -> bool:
    """Explicit, or: not on the meta device, and on a GPU only with room for
    eager's step on a copy of the model beside the plan's."""
    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    tensors += list(model.parameters())
    if any(t.device.type == "meta" for t in tensors):
        if verify:
            raise ValueError("verify=True needs real tensors: the model or the inputs "
                             "are on the meta device")
        return False
    if verify is not None:
        return verify
    cuda = [t for t in tensors if t.device.type == "cuda"]
    if cuda:
        free, _ = torch.cuda.mem_get_info(cuda[0].device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return free > 2 * (weights + peak)
    return True


def _timer(measure_time, model, inputs, loss_fn, mode, safety, label, dp) -> StepTimer | None:
    """What times plans against eager's step here (Note [measured at the front
    door]), or None: not asked, or the step does not run here as planned."""
    if measure_time is False:
        return None
    why = ("verify=False or the meta device: eager's step was not run" if safety is None
           else "the plan is for another device (a roofline profile)"
           if not label.startswith("measured")
           else "a data-parallel plan is timed on its group (bench ddp)" if dp is not None
           else None)
    if why is not None:
        if measure_time:
            raise ValueError(f"measure_time=True cannot time plans here: {why}")
        return None
    return StepTimer(model, inputs, loss_fn, mode, eager=safety.ref.ref)


def _objective(mem_budget, lat_budget, before: State, reference: int) -> Objective:
    """What the search optimizes for the budget (no budget: ``DEFAULT_LAT``); a
    memory ratio is of ``reference`` (Note [the budget's baseline])."""
    if mem_budget is not None:
        return Objective("mem", _parse_mem(mem_budget, reference)[0])
    ratio = DEFAULT_LAT if lat_budget is None else float(lat_budget)
    return Objective("lat", ratio * before.latency)


def _device_of(model: nn.Module, inputs) -> str:
    """Where the step runs: the inputs' device type (else the parameters')."""
    for t in list(tree_leaves(inputs)) + list(model.parameters()):
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def _low_precision(g) -> bool:
    """bf16/fp16 anywhere in the step (such parameters, or autocast regions)."""
    low = (torch.bfloat16, torch.float16)
    return any(t is not None and t.dtype in low for n in g.nodes for t in n.outputs)


def optimize(model: nn.Module, inputs, *, loss_fn: Callable | None = None, mode: str = "train",
             mem_budget: float | int | None = None, lat_budget: float | None = None,
             time_budget: float = 60.0, device_profile=None, seed: int = 0,
             progress: Callable[[Progress], object] | None = None,
             max_states: int | None = None, algebra: bool = True,
             fission: bool = True, swap: bool | None = None, tiles: bool | None = None,
             verify: bool | None = None, process_group=None, comm_link=None,
             bucket_cap_mb: float | None = None,
             measure_time: bool | None = None) -> OptimizeResult:
    """Capture ``model``'s step on ``inputs`` and search for a plan within a budget.

    ``mem_budget``: a ratio (<= 16) of eager PyTorch's step as it runs today,
    measured (``res.eager_peak``; the captured program's simulated peak where
    eager's step is not run: Note [the budget's baseline]), or bytes: the fastest
    plan under it; no plan measured above eager's step is returned as met.
    ``lat_budget``: a ratio of eager's measured step where plans are timed
    (``measure_time``), else of the captured program's simulated latency: the
    lowest peak within it. Neither: ``lat_budget=1.10``. ``device_profile``: None times
    ops on the inputs' device ("measured"); a profile name ("rtx3090", "a100",
    "h100", "h200", "cpu") plans with the roofline model of that device.
    ``time_budget`` (seconds) bounds the search; ``max_states`` also bounds it
    (makes a run reproducible regardless of speed). ``progress`` receives a
    `Progress` a few times a second and once at the end. Ctrl-C stops the
    search and returns the best plan so far (``interrupted=True``).
    ``algebra=False`` leaves out the TASO subset (merged matmuls, moved scales):
    the plan then runs the model's own ops, only re-ordered, split, recomputed
    or swapped. ``fission=False`` leaves out the F-Tree (no region is split):
    for a program that `torch.compile` will compile, which does not keep a
    split program's memory (see `bench.peers_compile`). ``tiles``: image regions
    split into tiles along height and width; None offers them for inference,
    True in a training step's backward too (Note [gradients in tiles]: exact,
    but no search has yet been measured to gain from them there, and they cost
    it time: docs/fission.md), False nowhere.

    ``swap`` (default: only when planning for a GPU: CUDA inputs or a GPU
    ``device_profile``) lets plans park activations in host memory. On the CPU,
    host and device memory are the same RAM and a swap saves the process
    nothing, so CPU plans use fission, recomputation and re-ordering alone;
    ``swap=True`` allows swaps there too (Note [which memory] in `search.report`).

    ``verify`` (default: wherever eager's step fits next to the plan's) runs the
    chosen plan once on ``inputs`` against an eager step and never returns one
    that raises or differs: the next plan of the front is taken and the failure
    kept in ``res.failed`` (`search.safety`). ``verify=False`` skips it (paper-size
    planning on the meta device never verifies).

    ``process_group`` (a group, or True for the default one; every rank calls
    `optimize` with its shard of the batch) plans the step for data parallel:
    the gradients go in buckets of ``bucket_cap_mb`` MiB (None: the size whose
    simulated step is fastest, `choose_cap`) whose ``all_reduce(async_op=True)``
    the program issues as soon as the planned backward has finished them,
    overlapping the rest of the backward; the search prices them on a third
    stream over ``comm_link`` (measured on the group when None; or "nvlink",
    "pcie", "ethernet") and counts the buckets' memory. Every rank then runs rank 0's plan (`search.data_parallel`).

    ``measure_time`` (default: where the step is verified here and op times are
    measured on this machine) times plans' steps against eager's in interleaved
    pairs and makes the choice on measured time: a memory budget gets the
    fastest measured of a few plans under it, and ``lat_budget`` (or the default
    x1.10) becomes a ratio of eager's measured step (Note [measured at the front
    door] in `search.measured_choice`). ``res.time_ratio`` is the chosen plan's
    measured ratio; ``measure_time=False`` keeps the simulated choice.

    An infeasible budget is not an error: the result holds the best plan reached,
    ``met=False`` and a message saying so.
    """
    if mem_budget is not None and lat_budget is not None:
        raise ValueError("give mem_budget or lat_budget, not both")
    # a torch.compile'd model is planned as the module it wraps: the plan is its step
    model = uncompiled(model)
    if mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', not {mode!r}")
    t0 = time.perf_counter()
    cost, async_copies, label = _cost_model(device_profile, inputs)   # bad names fail fast
    # a device with its own memory and copy engines beside it: a GPU, or a GPU
    # profile planned from this machine (`async_copies`); see Note [which memory]
    swap = async_copies if swap is None else bool(swap)
    # planning makes graphs of millions of objects: Note in `gcpause`
    with paused_gc():
        try:
            program = trace(model, inputs, loss_fn=loss_fn, mode=mode)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - see _bug
            raise CaptureError(_bug("building the program from the captured graph", e)) from e
        t_capture = time.perf_counter()
        dp = None
        if process_group is not None and process_group is not False:
            if mode != "train":
                raise ValueError("process_group plans a training step (mode='train')")
            dp, pick_cap = data_parallel(process_group, inputs, comm_link, bucket_cap_mb)
        try:
            space = Space(program, cost, async_copies=async_copies, algebra=algebra,
                          fission=fission, swap=swap, comm=dp, tiles=tiles)
            # The program as PyTorch runs it: its order, nothing applied.
            g = program.graph
            base_order = program.to_node_order(program.program_order())
            if dp is None:
                peak, latency = program.simulate().peak, sum(space.costs.of(g, v) for v in base_order)
            else:   # its buckets filled in PyTorch's order
                if pick_cap:
                    choose_cap(space, g, base_order)
                latency, tl_dp, *_ = space.with_buckets(g, base_order)
                peak = tl_dp.peak
            meta = {}
            if space.phased:    # as it runs: Note [whole phases run as one kernel]
                peak, latency, meta = space.fused(g, base_order, peak, latency, in_place=False)
            before = State((), (), g, [], base_order, peak, latency, [], 0, meta=meta)
            root = split_first(space, space.evaluate((), (), g))
            # the user's own checkpointing, re-derived: a start no worse than their eager step
            user_ck = user_checkpoint_state(space, root)
        except Exception as e:  # noqa: BLE001
            raise PlanError(_bug("analysing the program", e, hint=True)) from e
        # Note [the budget's baseline]: eager's step, measured, before the search
        safety = None
        if _should_verify(verify, model, inputs, before.peak):
            try:
                safety = SafetyNet(model, inputs, loss_fn, mode, seed,
                                   low_precision=_low_precision(g),
                                   phased=any(n.target in PHASED_TARGETS for n in g.ops))
            except Exception as e:  # noqa: BLE001
                raise PlanError(f"eager PyTorch's own step failed on these inputs "
                                f"({type(e).__name__}: {e}); the plans cannot be checked "
                                "against it: fix the model or pass verify=False") from e
        eager_peak = safety.ref.eager_peak if safety is not None else None
        objective = _objective(mem_budget, lat_budget, before,
                               eager_peak if eager_peak is not None else before.peak)

        def report(best: State, states: int, elapsed: float, done: bool):
            if progress is not None:
                progress(Progress(elapsed, float(time_budget), states, best.peak, best.latency,
                                  eager_peak or before.peak, before.latency, done))

        t_analysis = time.perf_counter()
        try:
            log = search(space, root, objective, time_budget=time_budget, seed=seed,
                         max_states=max_states, progress=report,
                         starts=[user_ck] if user_ck is not None else ())
        except Exception as e:  # noqa: BLE001
            raise PlanError(_bug("the search", e, hint=True)) from e
    if hasattr(cost, "save"):
        cost.save()  # measured op times: the next optimize on this machine reuses them
    builder = _Builder(model, space, before, label, safety)
    front = pareto_add(list(log.pareto), before)
    res = OptimizeResult(mode, None, None, None, builder.plan_of(before), None,
                         [builder.plan_of(s) for s in front], False, "", label,
                         time.perf_counter() - t0, log.states, log.interrupted, builder)
    res.device, res.swap = _device_of(model, inputs), swap
    res.loss_at = space.program.captured.loss_at
    res.eager_peak = eager_peak
    res.timings = {"capture": t_capture - t0, "analysis": t_analysis - t_capture,
                   "search": log.seconds}
    res.too_big = log.too_big
    res.timer = _timer(measure_time, model, inputs, loss_fn, mode, safety, label, dp)
    builder.select(res, mem_budget, lat_budget)
    res.seconds = time.perf_counter() - t0     # the timing of plans included
    if dp is not None:
        agree(res, space, builder)
    return res
