"""Side-by-side benchmarks of zero_plugin against torch DDP, ZeroRedundancyOptimizer and FSDP2.

Run ``python -m benchmarks.compare --help``; results land in ``benchmarks/results/``.
"""

__all__: list[str] = []
