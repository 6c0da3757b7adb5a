"""``optimize(..., process_group=...)``: one plan for every rank of a data-parallel job.

Every rank calls `optimize` with its own shard of the batch (same shapes). The
link is measured on the group (or named), every rank searches with the gradient
buckets priced in (`Space(comm=...)`), and then all take rank 0's choice: searches
time ops and stop on the clock, so ranks may pick differently, and a bucket
layout that differs between ranks would reduce the wrong bytes. A rank whose own
search chose another plan rebuilds rank 0's from its key (fission regions and
rewrites), which names the same candidates and ops on every rank (the capture
and the F-Tree are deterministic); the bucket layouts are compared before any
step runs.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from ..distributed import DEFAULT_CAP, CommLink, DataParallel, measure_link, nominal_link
from ..distributed.buckets import dense_bytes


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group needs torch.distributed initialized "
                         "(torch.distributed.init_process_group) on every rank")
    return dist


def data_parallel(process_group, inputs, link=None, bucket_cap_mb: float | None = None
                  ) -> tuple[DataParallel, bool]:
    """The `DataParallel` of ``optimize``'s arguments, and whether its bucket size
    is still to choose (`choose_cap`): ``process_group`` True for the default
    group; ``link`` a `CommLink`, a name of `distributed.comm.LINKS`, or None to
    measure the group (a collective)."""
    dist = _dist()
    group = None if process_group is True else process_group
    if isinstance(link, CommLink):
        lk = link
    elif link is not None:
        lk = nominal_link(link, dist.get_world_size(group))
    else:
        dev = next((x.device for x in tree_leaves(inputs) if isinstance(x, torch.Tensor)),
                   torch.device("cpu"))
        lk = measure_link(group, dev if dist.get_backend(group) == "nccl" else "cpu")
    cap = DEFAULT_CAP if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
    return DataParallel(group, lk, cap), bucket_cap_mb is None


def choose_cap(space, graph, order) -> None:
    """The bucket size, when the user gave none: the one whose simulated step
    (PyTorch's order, the measured link) is fastest among DDP's 25 MiB and 1/2 to
    1/16 of all the gradients (no less than 64 KiB); ties go to fewer buckets.
    Small models fit in one 25 MiB bucket, which is issued only when the
    backward ends and hides nothing; many small buckets pay the link's latency
    per call. Rank 0's choice is every rank's (op times differ between ranks)."""
    import dataclasses

    dist = _dist()
    dp = space.comm
    total = sum(dense_bytes(graph.tensor(r))
                for r, role in zip(graph.outputs, graph.output_roles) if role and role[0] == "grad")
    caps = sorted({DEFAULT_CAP} | {max(total // k, 64 * 2**10) for k in (2, 4, 8, 16)}, reverse=True)
    best = None
    for cap in caps:
        space.comm = dataclasses.replace(dp, cap=cap)
        lat = space.with_buckets(graph, order)[0]
        if best is None or lat < best[0] * (1 - 1e-3):
            best = (lat, cap)
    box = [best[1]]
    dist.broadcast_object_list(box, src=_src(dp.group), group=dp.group)
    space.comm = dataclasses.replace(dp, cap=box[0])


def _src(group) -> int:
    dist = _dist()
    return dist.get_global_rank(group, 0) if group is not None else 0


def agree(res, space, builder) -> None:
    """Every rank takes rank 0's plan; the bucket layouts must match; from here
    on `res.module` all_reduces on the group."""
    dist = _dist()
    dp = space.comm
    st = res.plan.state
    key = [(st.plan, st.batches)]
    dist.broadcast_object_list(key, src=_src(dp.group), group=dp.group)
    plan, batches = key[0]
    if (plan, batches) != (st.plan, st.batches):
        g, kept = space.build(plan, batches)
        chosen = builder.plan_of(space.evaluate(plan, kept, g))
        res.plan = chosen
        res.message += " (rank 0's plan: every rank runs the same one)"
    st = res.plan.state
    _, _, buckets = space.bucketed(*st.runs)
    layout = [(b.nbytes, str(b.dtype)) for b in buckets]
    layouts = [None] * dist.get_world_size(dp.group)
    dist.all_gather_object(layouts, layout, group=dp.group)
    if any(lo != layout for lo in layouts):
        raise RuntimeError(f"the ranks' gradient buckets differ ({layouts}): every rank must "
                           "optimize the same model with inputs of the same shapes")
    res._modules.clear()
    builder.live = True
