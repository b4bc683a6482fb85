"""Every rule a composed experiment must pass before any process starts, by concern, and
the override errors and Fix lines a user reads."""
