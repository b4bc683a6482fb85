"""Training engines: the Megatron-Core (megatron_*) and DeepSpeed (deepspeed_*) trainers and the one training loop; their torch-free rules are in `engine_rules`."""
