"""The CPU storage tracker against hand-computed peaks."""
import torch

from magis_nb.runtime import MemoryTracker, measure_cpu, storage_bytes

MiB = 2**20
N = MiB // 4


def test_counts_each_storage_once_and_frees():
    x = torch.randn(N)

    def body():
        a = x * 2                  # +1 MiB
        v = a.view(512, 512).t()   # view: +0
        b = v + 1                  # +1 MiB -> 2 MiB tracked
        del a, v                   # a's storage dies with its last view: -1 MiB
        c = torch.empty(2 * N)     # +2 MiB -> 3 MiB tracked
        c.add_(1)                  # in place: +0
        return b.sum() + c.sum()

    m = measure_cpu(body, [x])
    assert m.baseline == MiB
    # b, c and the three 4-byte scalars of the last line are live together.
    assert m.peak == MiB + 3 * MiB + 3 * 4


def test_freed_memory_is_returned():
    t = MemoryTracker()
    with t:
        a = torch.zeros(N)
        del a
        b = torch.zeros(N)
    assert t.peak == MiB
    del b
    assert t.current == 0


def test_storage_bytes_dedups_views_and_tied():
    w = torch.randn(N)
    assert storage_bytes([w, w.view(2, -1), w[:10]]) == MiB
