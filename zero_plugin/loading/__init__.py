"""Model weights: meta-device construction, materialisation from safetensors / init functions, the lazy
``from_pretrained``, and quantized (QLoRA) bases.
"""
