"""Model families as declarations: one file per Hugging Face architecture (see declaration.py).

Modules: `declaration` (what a family is), one file per family, `registry` (which are
supported), `hf_config` (config.json <-> gridwright's model config) and `weight_table`
(the tensors, both directions). This package sits on the bottom floor with the config
schema: it imports nothing of gridwright's above it.
"""
