"""``zero_plugin.integrations.accelerate``: the Accelerate integration's public names."""

from .accelerate_plugin import Accelerator, ZeroPlugin

__all__ = ["Accelerator", "ZeroPlugin"]
