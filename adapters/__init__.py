"""Checkpoint conversion between Hugging Face and Megatron-Core (issue #4; not written yet)."""
