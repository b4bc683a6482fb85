"""gridwright: plan, validate, launch and measure Megatron-Core and DeepSpeed training runs."""
from .basics.known_warnings import filter_known_warnings

filter_known_warnings()
