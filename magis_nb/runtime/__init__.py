"""Generated programs, the OptimizedModule and memory measurement."""
from .codegen import compile_source, generate
from .measure import MemoryTracker, Measurement, measure_cpu, measure_cuda, model_baseline, storage_bytes
from .module import OptimizedModule, step_of

__all__ = ["generate", "compile_source", "OptimizedModule", "step_of", "MemoryTracker", "Measurement",
           "measure_cpu", "measure_cuda", "model_baseline", "storage_bytes"]
