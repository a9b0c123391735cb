"""What ``zp.setup`` builds: the engine base and registry (``engine``), the stage table (``stages``), the stage
0-2 engine (``replicated``; stage 3's is ``zero_plugin.stage3``) and their components (setup checks,
frozen-parameter guard, buffer averaging, shard math, hooks, heap trimming).
"""
