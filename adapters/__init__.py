"""Checkpoint conversion between Hugging Face, Megatron-Core and DeepSpeed, verified."""
