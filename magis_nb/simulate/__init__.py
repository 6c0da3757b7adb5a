"""Simulation of a schedule: memory (memory.py, pure Python), op costs (cost.py:
roofline against device profiles in profiles.py; measured.py: timed on this
device) and latency on a compute stream plus a copy stream (latency.py).

Only the memory model is re-exported here: the IR imports it, and cost/latency
import the IR, so they are imported from their modules.
"""
from .memory import MemGraph, MemoryTimeline, Storage, peak_memory, simulate_memory, storage_intervals

__all__ = ["MemGraph", "Storage", "MemoryTimeline", "simulate_memory", "peak_memory",
           "storage_intervals"]
