"""The benchmark behind ``make bench`` and ``ray-triton-shm bench``.

Every method runs against one Triton server (the node actor's when Ray is
used) and the same example models; see :mod:`.runner` for the flow.
"""

from ray_triton_shm._private.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "run_bench"]
