"""Base models: specs (hub id, local path or `tiny:<family>`), loading, the MoE layout, LoRA, tiny bases."""
