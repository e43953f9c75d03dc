"""The nano-vllm benchmark workload (kept for scripts that import it from here; it lives in fnvllm.benchmark)."""

from fnvllm.benchmark import bench_workload

__all__ = ["bench_workload"]
