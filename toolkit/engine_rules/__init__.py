"""Each engine's torch-free rules (what it accepts, its capabilities, its ZeRO settings) and
the one registry that picks an engine by name. Validation and planning read them without
loading an engine; the trainers live above, in `engines`."""
