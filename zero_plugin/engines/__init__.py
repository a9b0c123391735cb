"""What ``zp.setup`` builds: the engine base and registry (``engine``), the stage 0-2 engine (``replicated``;
stage 3's is ``zero_plugin.stage3``, the table that picks one is ``zero_plugin/stages.py``) and their components
(setup checks, frozen-parameter guard, buffer averaging, the stages 1-2 post-step all-gather ``param_sync``,
heap trimming, the colocate ``state_offload``).
"""
