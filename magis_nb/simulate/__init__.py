"""Simulation of a schedule: memory (memory.py, pure Python), op costs (cost.py:
roofline against device profiles; measured.py: timed on this device) and latency
on a compute stream plus a copy stream (latency.py)."""
from .cost import CostModel, RooflineCost, make_cost, op_bytes, op_flops
from .latency import LatencyResult, Transfer, program_latency, simulate_latency
from .memory import MemGraph, MemoryTimeline, Storage, peak_memory, simulate_memory, storage_intervals
from .profiles import PROFILES, DeviceProfile, get_profile

__all__ = ["MemGraph", "Storage", "MemoryTimeline", "simulate_memory", "peak_memory",
           "storage_intervals", "CostModel", "RooflineCost", "make_cost", "op_flops", "op_bytes",
           "LatencyResult", "Transfer", "simulate_latency", "program_latency", "PROFILES",
           "DeviceProfile", "get_profile"]
