"""Mint: LoRA GRPO post-training for frozen sparse-MoE bases, orchestrated by Ray."""

from mint.errors import MintError

__all__ = ["MintError"]
__version__ = "0.1.0"
