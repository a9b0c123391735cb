"""Communication: the only caller of torch.distributed (``collectives``), the collective layouts (``layout``) and
CUDA side streams (``streams``).
"""
