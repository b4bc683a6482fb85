"""Configuration: the typed schema, Hydra composition and the FP8 choice; the rules a config must pass are in `validation`."""
