"""Configuration: the typed schema, Hydra composition, and every rule a composed experiment must pass."""
