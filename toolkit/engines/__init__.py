"""Training engines: Megatron-Core (megatron_*) and DeepSpeed (deepspeed_engine)."""
