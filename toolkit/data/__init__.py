"""Training data: synthetic tokens, prepared indexed datasets, and the command that prepares them."""
