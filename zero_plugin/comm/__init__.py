"""Communication: the only caller of torch.distributed (``collectives``), its counters (``stats``), its cached
groups (``groups``) and async handles (``works``), the collective layouts (``layout``) and CUDA side streams
(``streams``).
"""
