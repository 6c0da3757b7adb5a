"""ddp: magis_nb data parallel (``optimize(..., process_group=True)``) against DDP.

Each model runs in its own job of 2 ranks (``--world``): processes started with
`torch.multiprocessing` (spawn), gloo on 127.0.0.1 at a free port, one thread
per rank (``torch.set_num_threads(1)``). The full batch is the tiny zoo inputs
(gpt: 48 sequences, unet: 16 images), split along dim 0 into one shard per rank;
a batch that does not split evenly into shards of at least 2 is first repeated
(``torch.cat`` of copies along dim 0, ``batch_repeat`` in the row). Every model
starts from the same weights (the zoo builds them from seed 0; each side below
trains a deepcopy made before anything trains), and every side trains with the
same optimizer, SGD lr ``--lr`` (0.1), ``--steps`` (3) steps:

Dropout (the tiny GPT's 0.1) is set to 0 unless ``--keep-dropout``: a rank draws
its masks for its own shard, and no single process on the full batch draws those,
so with dropout the single-process equality cannot hold. Each step is seeded
(``torch.manual_seed``, per rank and step, the same on every side), so with
``--keep-dropout`` DDP eager, magis and the wrapped plan draw the same masks and
must still agree with each other.

1. single: eager PyTorch, one process, the full batch (on rank 0, broadcast);
2. DDP eager: `DistributedDataParallel(copy, broadcast_buffers=False)` with each
   rank's shard (``broadcast_buffers=False``: each rank keeps its own running
   stats, as magis_nb's plan does; DDP would otherwise copy rank 0's at every
   forward);
3. magis: ``optimize(copy, shard, process_group=True, lat_budget|mem_budget,
   time_budget, max_states)``, then ``loss = mod(*shard); loss.backward();
   opt.step()``;
4. wrapped: a plain plan (no process group, each rank's own search) wrapped as
   `DistributedDataParallel(plain.module, broadcast_buffers=False)`: DDP's
   reducer hooks see the gradients the planned step hands through autograd.

Reported per model (max over ranks where a rank-local number is involved):

* ``allclose_single`` / ``allclose_ddp`` / ``allclose_ddp_wrapped``: the
  weights (and buffers) after the steps, magis against single and DDP eager,
  the wrapped plan against DDP eager; every rank's, rtol 1e-4, atol 1e-5; the
  largest difference next to each (``max_diff_*``). With BatchNorm (``unet``)
  each rank normalizes with its shard's statistics, so neither DDP eager nor
  magis can equal the single process on the full batch (``note``); they must
  equal each other.
* ``step_ratio_vs_ddp``: a full training step (zero_grad, forward, backward with
  its all_reduces, optimizer step), magis over DDP eager: after ``--warmup``
  pairs, ``--reps`` pairs (DDP, magis) timed in lockstep (a barrier before every
  timed step, the two orders alternating from pair to pair), each step's time
  the slowest rank's; the median of the per-pair ratios and their quartiles.
* ``allreduce_hidden_fraction``: from magis's own bucket records over the timed
  steps (`BucketComm.record`): exposed = the time a step waits on its
  all_reduces (sum of wait_end - wait_start), the slowest rank's, median over
  steps (``exposed_ms``); comm = the time of blocking all_reduces of the same
  bucket sizes in lockstep right after (the slowest rank's median,
  ``comm_ms``); hidden = 1 - exposed / comm, clamped to [0, 1]. A rank that
  finishes its backward later than the other shows as exposed time on the
  earlier one (the wait includes the skew): ``skew_ms`` is that part,
  ``exposed_after_issue_ms`` / ``hidden_after_issue`` the rest (`overlap`);
  ``per_bucket`` how long before its wait each bucket was issued and how long
  the wait took. ``issued_before_wait``: every bucket was issued before its
  wait began. With the default 25 MB cap the tiny models' gradients (< 2 MiB)
  make one bucket, ready only when the backward ends, so nothing can hide;
  ``--bucket-cap-mb`` (DDP gets the same cap) makes several.
* ``peak_ratio``: the measured peak of one forward + backward (`measure_cpu`:
  storages live before it, i.e. weights, inputs, magis's lifted constants,
  plus those allocated during it), the slowest rank's, magis over DDP eager.
  DDP's persistent bucket buffers (about one copy of every gradient,
  ``ddp_bucket_bytes``) are allocated when the DDP module is built, so they
  are outside its measured step peak: that favours DDP. magis's buckets are
  allocated inside the step and are counted.
* ``plan`` (res.message), ``sim_peak`` (res.plan.peak, buckets included),
  ``magis_peak`` / ``ddp_peak`` (bytes), ``buckets``, ``link``.

The budget (``--budget``, default ``mem:0.4``) is the plan's: a memory ratio
(the fastest plan under it) or ``lat:RATIO`` on its *simulated* latency (buckets
priced on the measured gloo link). A latency budget is not re-fitted on measured
time here (``fit_measured`` times plans one rank alone), and on these tiny
models the simulator prices many-part splits as cheaper than they run (the
tiny GPT split in 24 simulated x0.975, measured x1.36 of DDP), so the default
asks for memory.
"""
from __future__ import annotations

import copy
import os
import queue
import socket
import statistics
import time
import traceback
import warnings
from datetime import timedelta

import torch

from .common import parser, table, write_json

DEFAULT_MODELS = ("gpt", "unet")
RTOL, ATOL = 1e-4, 1e-5
SEED = 1
BN_NOTE = ("BatchNorm: each rank normalizes with its own shard's batch statistics, so neither "
           "DDP eager nor magis can equal one process on the full batch; DDP eager runs with "
           "broadcast_buffers=False so both sides keep per-rank running stats")
DROPOUT_NOTE = ("dropout kept: each rank draws masks for its own shard (seeded alike on the DDP "
                "and magis sides), which no single process on the full batch draws")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_batch(inputs: tuple, world: int) -> tuple[tuple, int]:
    """(inputs whose dim 0 splits into ``world`` equal shards of at least 2, how
    many copies of the batch that took)."""
    n = inputs[0].shape[0]
    k = 1
    while (n * k) % world or n * k < 2 * world:
        k += 1
    if k > 1:
        inputs = tuple(torch.cat([t] * k) for t in inputs)
    return inputs, k


def shard_of(inputs: tuple, world: int, rank: int) -> tuple:
    # a copy: a slice along dim 0 is already contiguous and would keep the whole
    # batch's storage alive, which the measured peaks would count (not the shard)
    return tuple(t.chunk(world)[rank].clone() for t in inputs)


# -- one rank ----------------------------------------------------------------------------

def _state(model) -> dict:
    """Parameters and floating buffers by name, detached."""
    out = {f"p:{n}": p.detach() for n, p in model.named_parameters()}
    out.update({f"b:{n}": b.detach() for n, b in model.named_buffers() if b.is_floating_point()})
    return out


def _compare(a: dict, b: dict) -> tuple[bool, float]:
    if a.keys() != b.keys():
        raise RuntimeError(f"the models' states differ in names: {sorted(a.keys() ^ b.keys())[:5]}")
    ok, worst = True, 0.0
    for k, x in a.items():
        x, y = x.float(), b[k].float()
        ok = ok and bool(torch.allclose(x, y, rtol=RTOL, atol=ATOL))
        worst = max(worst, float((x - y).abs().max()) if x.numel() else 0.0)
    return ok, worst


def _max(dist, xs) -> list[float]:
    t = torch.tensor(list(xs), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _agree(dist, ok: bool, diff: float) -> tuple[bool, float]:
    """(every rank ok, largest difference of any rank)."""
    bad, worst = _max(dist, [0.0 if ok else 1.0, diff])
    return bad == 0.0, worst


def _train(step, opt, steps: int, seed: int | None = None) -> list[float]:
    """``steps`` optimizer steps; with ``seed``, the RNG seeded ``seed + k`` before
    step k (dropout draws the same masks on every side that gets the same seeds)."""
    losses = []
    for k in range(steps):
        if seed is not None:
            torch.manual_seed(seed + k)
        opt.zero_grad(set_to_none=True)
        losses.append(float(step()))
        opt.step()
    return losses


def overlap(every: list, nb: int, comm_s: float) -> dict:
    """The all_reduces' overlap from every rank's bucket records ``every[rank] =
    [(bucket, nbytes, issued, wait_start, wait_end)]``, ``nb`` records a step, and
    the blocking time ``comm_s`` of the same buckets.

    exposed: a step's waits (sum of wait_end - wait_start), the slowest rank's,
    median over steps. A wait also covers the time until the other rank issues
    the same bucket (its backward finished later): ``skew_ms`` is that part
    (until the last rank's issue; perf_counter is the system's monotonic clock,
    one clock for every process here), and ``exposed_after_issue_ms`` the rest,
    with ``hidden_after_issue`` = 1 - that / comm."""
    out = {"allreduce_hidden_fraction": None, "comm_ms": round(comm_s * 1e3, 3),
           "exposed_ms": None, "skew_ms": None, "exposed_after_issue_ms": None,
           "hidden_after_issue": None, "issued_before_wait": None, "per_bucket": []}
    if not nb or not every[0]:
        return out
    steps = min(len(r) for r in every) // nb
    exposed, after, skew = [], [], []
    for k in range(steps):
        rows = [r[k * nb:(k + 1) * nb] for r in every]
        last = [max(r[j][2] for r in rows) for j in range(nb)]
        waits = [sum(we - ws for _, _, _, ws, we in r) for r in rows]
        afters = [sum(max(0.0, we - max(ws, last[j])) for j, (_, _, _, ws, we) in enumerate(r))
                  for r in rows]
        exposed.append(max(waits))
        after.append(max(afters))
        skew.append(max(w - a for w, a in zip(waits, afters)))
    e, a = statistics.median(exposed), statistics.median(after)
    # per bucket, medians over steps and ranks: issued how long before the step
    # waits on it (lead), the wait, and how long after the last rank issued it
    # the wait ended (the all_reduce's own time in the step, at most)
    per_bucket = []
    for j in range(nb):
        lead, wait, done = [], [], []
        for k in range(steps):
            recs = [r[k * nb + j] for r in every]
            last = max(x[2] for x in recs)
            for _, _, i, ws, we in recs:
                lead.append(ws - i)
                wait.append(we - ws)
                done.append(we - last)
        per_bucket.append({"bytes": every[0][j][1],
                           "lead_ms": round(statistics.median(lead) * 1e3, 3),
                           "wait_ms": round(statistics.median(wait) * 1e3, 3),
                           "done_after_issue_ms": round(statistics.median(done) * 1e3, 3)})

    def hidden(x):
        return round(min(1.0, max(0.0, 1.0 - x / comm_s)), 4) if comm_s > 0 else None

    out.update(allreduce_hidden_fraction=hidden(e), exposed_ms=round(e * 1e3, 3),
               skew_ms=round(statistics.median(skew) * 1e3, 3),
               exposed_after_issue_ms=round(a * 1e3, 3), hidden_after_issue=hidden(a),
               issued_before_wait=all(i <= ws for r in every for _, _, i, ws, _ in r),
               per_bucket=per_bucket)
    return out


def _rank_work(rank: int, world: int, port: int, cfg: dict) -> dict | None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import zoo
    from ..capture import call_step
    from ..runtime.measure import measure_cpu, model_baseline
    from ..search import optimize

    torch.set_num_threads(1)
    # deprecated in favour of forward_sync_buffers, which still syncs at init: the
    # warning itself says to keep broadcast_buffers=False for rank-local buffers
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=cfg["timeout"]))
    t_start = time.perf_counter()
    name = cfg["model"]
    case = zoo.build(name, "tiny")
    drops = [m for m in case.model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]
    dropout = sorted({m.p for m in drops})
    if not cfg["keep_dropout"]:
        for m in drops:
            m.p = 0.0
    init = copy.deepcopy(case.model)          # before anything trains
    full, repeat = split_batch(tuple(case.inputs), world)
    shard = shard_of(full, world, rank)
    loss_fn = case.loss_fn
    steps, lr = cfg["steps"], cfg["lr"]

    def sgd(params):
        return torch.optim.SGD(params, lr=lr)

    # 1. single process, full batch (rank 0), then every rank holds its weights
    single = [None]
    if rank == 0:
        m1 = copy.deepcopy(init)
        _train(lambda: _backward(call_step(m1, full, loss_fn)), sgd(m1.parameters()), steps, SEED)
        single = [_state(m1)]
        del m1
    dist.broadcast_object_list(single, src=0)
    single = single[0]

    # 2. DDP eager on the shards
    ddp_kw = {"bucket_cap_mb": cfg["bucket_cap_mb"]} if cfg["bucket_cap_mb"] else {}
    m_ddp = copy.deepcopy(init)
    ddp = DDP(m_ddp, broadcast_buffers=False, **ddp_kw)
    opt_ddp = sgd(ddp.parameters())

    def ddp_step():
        return _backward(call_step(ddp, shard, loss_fn))

    seed = SEED + 1000 * rank                 # each rank its own dropout masks, alike on every side
    ddp_losses = _train(ddp_step, opt_ddp, steps, seed)

    # 3. magis data parallel
    kind, budget = cfg["budget"]
    m_mag = copy.deepcopy(init)
    t0 = time.perf_counter()
    res = optimize(m_mag, shard, loss_fn=loss_fn, process_group=True,
                   **{f"{kind}_budget": budget}, time_budget=cfg["time_budget"],
                   max_states=cfg["max_states"], bucket_cap_mb=cfg["bucket_cap_mb"])
    optimize_s = time.perf_counter() - t0
    mod = res.module
    opt_mag = sgd(m_mag.parameters())

    def magis_step():
        return _backward(mod(*shard))

    mag_losses = _train(magis_step, opt_mag, steps, seed)
    ok_single, d_single = _agree(dist, *_compare(_state(m_mag), single))
    ok_ddp, d_ddp = _agree(dist, *_compare(_state(m_mag), _state(m_ddp)))

    # 4. a plain plan (this rank's own search) wrapped in DDP
    m_pl = copy.deepcopy(init)
    plain = optimize(m_pl, shard, loss_fn=loss_fn, **{f"{kind}_budget": budget},
                     time_budget=cfg["plain_time_budget"], max_states=cfg["plain_max_states"])
    wrapped = DDP(plain.module, broadcast_buffers=False, **ddp_kw)
    _train(lambda w=wrapped: _backward(w(*shard)), sgd(wrapped.parameters()), steps, seed)
    ok_wr, d_wr = _agree(dist, *_compare(_state(m_pl), _state(m_ddp)))
    plain_msg = plain.message
    del wrapped, plain, m_pl

    # peaks: one forward + backward each, gradients None before
    opt_ddp.zero_grad(set_to_none=True)
    dist.barrier()
    ddp_peak = measure_cpu(ddp_step, model_baseline(m_ddp, shard)).peak
    opt_ddp.zero_grad(set_to_none=True)
    opt_mag.zero_grad(set_to_none=True)
    dist.barrier()
    magis_peak = measure_cpu(magis_step, model_baseline(m_mag, shard) + mod.resident()).peak
    opt_mag.zero_grad(set_to_none=True)
    ddp_peak, magis_peak = (int(v) for v in _max(dist, [ddp_peak, magis_peak]))

    # timing: (DDP, magis) pairs in lockstep
    fns = (lambda: _train(ddp_step, opt_ddp, 1), lambda: _train(magis_step, opt_mag, 1))
    warmup, reps = cfg["warmup"], cfg["reps"]
    times = [[0.0, 0.0] for _ in range(reps)]
    mod.comm.record = True
    for i in range(warmup + reps):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            dist.barrier()
            t0 = time.perf_counter()
            fns[which]()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[i - warmup][which] = dt
        if i == warmup - 1:
            mod.comm.records.clear()
    mod.comm.record = False
    flat = _max(dist, [x for pair in times for x in pair])
    times = [flat[2 * k: 2 * k + 2] for k in range(reps)]
    ratios = [m / d for d, m in times]

    # the all_reduces: exposed in the steps, and blocking, same bucket sizes
    st = res.plan.state
    buckets = res.builder.space.bucketed(*st.runs)[2]
    comm = []
    if buckets:
        bufs = [torch.zeros(b.nbytes // b.dtype.itemsize, dtype=b.dtype) for b in buckets]
        for i in range(1 + reps):
            dist.barrier()
            t0 = time.perf_counter()
            for x in bufs:
                dist.all_reduce(x)
            if i:
                comm.append(time.perf_counter() - t0)
        comm = _max(dist, comm)
    mine = [(r.bucket, r.nbytes, r.issued, r.wait_start, r.wait_end) for r in mod.comm.records]
    every = [None] * world
    dist.all_gather_object(every, mine)
    comm_s = statistics.median(comm) if comm else 0.0
    ov = overlap(every, len(buckets), comm_s)
    grad_bytes = sum(p.numel() * p.element_size() for p in m_ddp.parameters() if p.requires_grad)
    link = res.builder.space.comm.link
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 2
    row = {
        "model": name, "ranks": world, "batch": int(full[0].shape[0]),
        "shard_batch": int(shard[0].shape[0]), "batch_repeat": repeat,
        "optimizer": f"SGD lr {lr}", "steps": steps,
        "allclose_single": ok_single, "max_diff_single": d_single,
        "allclose_ddp": ok_ddp, "max_diff_ddp": d_ddp,
        "allclose_ddp_wrapped": ok_wr, "max_diff_ddp_wrapped": d_wr,
        "losses_ddp": [round(v, 5) for v in ddp_losses],
        "losses_magis": [round(v, 5) for v in mag_losses],
        "step_ratio_vs_ddp": round(statistics.median(ratios), 4),
        "step_ratio_q1": round(q[0], 4), "step_ratio_q3": round(q[-1], 4),
        "ddp_step_ms": round(statistics.median(t[0] for t in times) * 1e3, 2),
        "magis_step_ms": round(statistics.median(t[1] for t in times) * 1e3, 2),
        "ratios": [round(r, 4) for r in ratios],
        **ov, "buckets": len(buckets), "bucket_bytes": [b.nbytes for b in buckets],
        # magis's own choice when none was given (`choose_cap`); DDP then has its 25
        "bucket_cap_mb": round(res.builder.space.comm.cap / 2**20, 4),
        "peak_ratio": round(magis_peak / ddp_peak, 4),
        "magis_peak": magis_peak, "ddp_peak": ddp_peak, "ddp_bucket_bytes": grad_bytes,
        "sim_peak": res.plan.peak, "sim_before_peak": res.before.peak,
        "sim_lat_ratio": round(res.lat_ratio, 4),
        "plan": res.message, "applied": res.plan.applied, "met": res.met,
        "budget": f"{kind}:{budget:g}", "states": res.states, "optimize_s": round(optimize_s, 1),
        "plain_plan": plain_msg,
        "link": f"{link.label}: {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us",
        "dropout": ("none" if not drops else f"{dropout} (zoo)" if cfg["keep_dropout"]
                    else f"0 (zoo: {dropout})"),
        "note": "; ".join(
            ([BN_NOTE] if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                              for m in init.modules()) else [])
            + ([DROPOUT_NOTE] if drops and cfg["keep_dropout"] else [])),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    dist.barrier()
    dist.destroy_process_group()
    return row if rank == 0 else None


def _backward(loss):
    loss.backward()
    return loss.detach()


def _rank(rank: int, world: int, port: int, cfg: dict, q) -> None:
    """A spawned rank: its row (rank 0) or None, or its traceback, on ``q``."""
    try:
        q.put(("ok", rank, _rank_work(rank, world, port, cfg)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        q.put(("error", rank, traceback.format_exc()))


# -- the parent --------------------------------------------------------------------------

def run_ranks(target, world: int, cfg: dict, timeout: float) -> list:
    """Run ``target(rank, world, port, cfg, queue)`` in ``world`` spawned processes;
    each puts ("ok", rank, value) or ("error", rank, traceback) on the queue.
    Returns the values by rank; raises RuntimeError with the first failing rank's
    traceback, or on a timeout (the processes are then killed)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, cfg, q)) for r in range(world)]
    for p in procs:
        p.start()
    values: dict[int, object] = {}
    error = None
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"timed out after {timeout:g} s (ranks done: {sorted(values)})"
                break
            try:
                kind, rank, val = q.get(timeout=min(left, 5.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and r not in values]
                if dead:
                    # give its message (if any) a moment to arrive
                    try:
                        kind, rank, val = q.get(timeout=5.0)
                    except queue.Empty:
                        error = (f"rank {dead[0]} exited (status {procs[dead[0]].exitcode}) "
                                 "without a result")
                        break
                else:
                    continue
            if kind == "ok":
                values[rank] = val
            else:
                error = f"rank {rank} failed:\n{val}"
    finally:
        for p in procs:
            p.join(timeout=10 if error is None else 2)
        status = {r: p.exitcode for r, p in enumerate(procs)}
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()
    if error is not None:
        raise RuntimeError(f"{error}\nexit status by rank (None: still running, killed): {status}")
    return [values[r] for r in range(world)]


def model_row(name: str, cfg: dict, world: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        row = run_ranks(_rank, world, dict(cfg, model=name), timeout)[0]
    except RuntimeError as e:
        return {"model": name, "ranks": world, "error": str(e),
                "seconds": round(time.perf_counter() - t0, 1)}
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


COLS = [("model", "model"), ("ranks", "ranks"), ("allclose_single", "single"),
        ("allclose_ddp", "ddp"), ("allclose_ddp_wrapped", "wrapped"),
        ("step_ratio_vs_ddp", "step/ddp"), ("step_ratio_q1", "q1"), ("step_ratio_q3", "q3"),
        ("ddp_step_ms", "ddp ms"), ("magis_step_ms", "magis ms"),
        ("allreduce_hidden_fraction", "hidden"), ("comm_ms", "comm ms"),
        ("exposed_ms", "exposed ms"), ("skew_ms", "skew ms"), ("hidden_after_issue", "hidden*"),
        ("buckets", "buckets"), ("peak_ratio", "peak/ddp"),
        ("magis_peak", "magis peak"), ("ddp_peak", "ddp peak"), ("sim_peak", "sim peak"),
        ("applied", "applied"), ("wall_s", "s")]


def main(argv) -> int:
    p = parser("ddp", __doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="tiny zoo models (default gpt,unet; also e.g. unet-nobn)")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps compared (default 3)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--reps", type=int, default=15, help="timed (DDP, magis) pairs (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed pairs first (default 3)")
    p.add_argument("--budget", default="mem:0.4",
                   help="the plan's budget: lat:RATIO or mem:RATIO (default mem:0.4)")
    p.add_argument("--time-budget", type=float, default=20.0, help="search seconds (default 20)")
    p.add_argument("--max-states", type=int, default=40, help="search states (default 40)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="gradient bucket cap for magis and DDP alike (default: DDP's 25, and "
                   "magis's choice of the simulated step's fastest)")
    p.add_argument("--keep-dropout", action="store_true",
                   help="keep the zoo's dropout (gpt: 0.1); by default it is set to 0, so that "
                   "single-process equality can hold")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per model (default 900)")
    a = p.parse_args(argv)
    kind, _, val = a.budget.partition(":")
    if kind not in ("lat", "mem") or not val:
        p.error(f"--budget must be lat:RATIO or mem:RATIO, not {a.budget!r}")
    cfg = {"steps": a.steps, "lr": a.lr, "reps": a.reps, "warmup": a.warmup,
           "budget": (kind, float(val)), "time_budget": a.time_budget,
           "max_states": a.max_states, "plain_time_budget": max(2.0, a.time_budget / 4),
           "plain_max_states": max(4, a.max_states // 4), "bucket_cap_mb": a.bucket_cap_mb,
           "timeout": a.timeout, "keep_dropout": a.keep_dropout}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    t0 = time.perf_counter()
    for name in a.models.split(","):
        r = model_row(name, cfg, a.world, a.timeout)
        rows.append(r)
        if "error" in r:
            print(f"{name}: FAILED: {r['error']}", flush=True)
        else:
            print(table([r], COLS), flush=True)
            print(f"  plan: {r['plan']}\n  link: {r['link']}"
                  + (f"\n  note: {r['note']}" if r["note"] else ""), flush=True)
    ok = [r for r in rows if "error" not in r]
    if ok:
        print(table(ok, COLS))
    print(f"{len(rows)} models in {time.perf_counter() - t0:.0f} s")
    write_json(a.json, rows)
    bad = [r for r in rows if "error" in r or not r["allclose_ddp"] or not r["allclose_ddp_wrapped"]
           or (not r["note"] and not r["allclose_single"])]
    return 1 if bad else 0
