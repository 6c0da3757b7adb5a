"""Device profiles for the roofline cost model: peak FLOP/s, memory and host-link bandwidth.

All GPU numbers are vendor datasheet peaks for *dense* math (the datasheets also
quote 2x "with sparsity" figures, which a training step never reaches). The host
link is the PCIe (or NVLink-C2C) bandwidth a Store/Load swap runs at: PCIe 4.0 x16
is 32 GB/s per direction on paper and ~25 GB/s measured with pinned memory;
PCIe 5.0 x16 is 64 GB/s on paper and ~50 GB/s measured.

``flops`` is keyed by dtype name ("float32", "tfloat32", "bfloat16", "float16",
"float64"). "tfloat32" is the tensor-core rate that fp32 matmuls and convolutions
run at when TF32 is allowed (the paper's setting for its fp32 models).

The launch overhead (5 us on GPUs) is an assumption, not a datasheet number: the
cost of a kernel launch plus the dispatcher, as seen in eager PyTorch traces.

"cpu" is this machine, measured once per process (and thread count) by a short
matmul + copy micro-benchmark; see `cpu_profile`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

__all__ = ["DeviceProfile", "PROFILES", "get_profile", "profile_names", "cpu_profile"]


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: dict = field(hash=False)   # dtype name -> peak FLOP/s (dense)
    mem_bw: float                     # device memory bytes/s
    host_link_bw: float               # device <-> host bytes/s, one direction (swaps)
    launch_overhead_s: float          # added to every op that launches a kernel
    display: str = ""                 # the name a report gives it ("RTX 3090"); name if empty
    gpu: bool = True                  # a GPU: plans for it run here as a stand-in (reports)

    @property
    def title(self) -> str:
        return self.display or self.name

    def peak(self, dtype_name: str) -> float:
        """Peak FLOP/s for ``dtype_name``; unknown dtypes (ints, bool) use float32."""
        f = self.flops.get(dtype_name)
        return f if f else self.flops["float32"]


PROFILES: dict[str, DeviceProfile] = {
    # NVIDIA Ampere GA102 GPU architecture whitepaper (v2.0), Table 9 "GeForce RTX
    # 3090": FP32 35.6 TFLOPS; TF32 tensor 35.6 dense (71 sparse); FP16/BF16 tensor
    # with FP32 accumulate 71 dense (142 sparse); FP64 1/64 rate = 0.556; GDDR6X
    # 19.5 Gbps x 384 bit = 936 GB/s. PCIe 4.0 x16.
    "rtx3090": DeviceProfile(
        "rtx3090",
        {"float32": 35.6e12, "tfloat32": 35.6e12, "bfloat16": 71e12, "float16": 71e12,
         "float64": 0.556e12},
        mem_bw=936e9, host_link_bw=25e9, launch_overhead_s=5e-6, display="RTX 3090"),
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM": FP32 19.5 TFLOPS; TF32
    # tensor 156 dense (312 sparse); BF16/FP16 tensor 312 dense (624 sparse); FP64
    # tensor 19.5; HBM2e 2,039 GB/s (the 40 GB part has 1,555 GB/s). PCIe 4.0 x16.
    "a100": DeviceProfile(
        "a100",
        {"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12,
         "float64": 19.5e12},
        mem_bw=2.039e12, host_link_bw=25e9, launch_overhead_s=5e-6, display="A100"),
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM": FP32 67 TFLOPS; TF32 tensor
    # 989 with sparsity = 494.5 dense; BF16/FP16 tensor 1,979 with sparsity = 989.5
    # dense; FP64 tensor 67; HBM3 3.35 TB/s. PCIe 5.0 x16.
    "h100": DeviceProfile(
        "h100",
        {"float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12,
         "float64": 67e12},
        mem_bw=3.35e12, host_link_bw=50e9, launch_overhead_s=5e-6, display="H100"),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM": the same compute as H100 SXM
    # (FP32 67, TF32 989 / BF16 1,979 with sparsity, i.e. half that dense); HBM3e
    # 141 GB at 4.8 TB/s. PCIe 5.0 x16.
    "h200": DeviceProfile(
        "h200",
        {"float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12,
         "float64": 67e12},
        mem_bw=4.8e12, host_link_bw=50e9, launch_overhead_s=5e-6, display="H200"),
}


def profile_names() -> list[str]:
    return sorted(PROFILES) + ["cpu"]


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    """A named profile ("rtx3090", "a100", "h100", "h200", "cpu"), or pass one through."""
    if isinstance(name, DeviceProfile):
        return name
    key = name.lower().replace("-", "").replace(" ", "")
    if key == "cpu":
        return cpu_profile()
    if key not in PROFILES:
        raise KeyError(f"unknown device profile {name!r}; known: {', '.join(profile_names())}")
    return PROFILES[key]


_CPU_CACHE: dict[int, DeviceProfile] = {}


def cpu_profile(refresh: bool = False) -> DeviceProfile:
    """This CPU at the current torch thread count, measured once and kept in memory.

    Peak FLOP/s: best of a few 256^3 matmuls (fp32 and bf16). Memory bandwidth:
    best of a few 64 MiB copies, counting read + write bytes (as the roofline counts
    input + output bytes). Launch overhead: the median time of an op on a 1-element
    tensor (dispatcher cost). Takes well under a second.
    """
    import torch

    threads = torch.get_num_threads()
    if not refresh and threads in _CPU_CACHE:
        return _CPU_CACHE[threads]

    def best(fn, reps):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts), statistics.median(ts)

    g = torch.Generator().manual_seed(0)
    n = 256
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    fp32 = 2 * n**3 / best(lambda: torch.mm(a, b), 8)[0]
    ab, bb = a.bfloat16(), b.bfloat16()
    bf16 = 2 * n**3 / best(lambda: torch.mm(ab, bb), 8)[0]
    src = torch.empty(16 * 2**20)     # 64 MiB of fp32, larger than the caches
    src.fill_(1.0)
    dst = torch.empty_like(src)
    bw = 2 * src.nbytes / best(lambda: dst.copy_(src), 8)[0]
    one = torch.ones(1)
    launch = best(lambda: torch.add(one, one), 50)[1]
    prof = DeviceProfile(
        "cpu",
        {"float32": fp32, "tfloat32": fp32, "bfloat16": bf16, "float64": fp32 / 2},
        # a swap of n bytes on the CPU is a copy: it reads n and writes n, so it
        # moves n bytes at half the read + write bandwidth
        mem_bw=bw, host_link_bw=bw / 2, launch_overhead_s=launch, display="this CPU", gpu=False)
    _CPU_CACHE[threads] = prof
    return prof
