"""MLflow tracking: runs, stores, sweeps and the comparison of their points."""
