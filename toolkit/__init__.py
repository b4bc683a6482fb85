"""gridwright: plan, validate, launch and measure Megatron-Core and DeepSpeed training runs."""
import warnings

# Expected wherever Transformer Engine and Apex are absent (CPU, and the GPU machines used
# here); Megatron-Core then uses its torch fallbacks. Shown once in the README instead.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
