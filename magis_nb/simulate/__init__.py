"""Memory (and later latency) simulation of a schedule."""
from .memory import MemGraph, MemoryTimeline, Storage, peak_memory, simulate_memory, storage_intervals

__all__ = ["MemGraph", "Storage", "MemoryTimeline", "simulate_memory", "peak_memory",
           "storage_intervals"]
