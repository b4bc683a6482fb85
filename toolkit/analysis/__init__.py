"""Analysis of what a run recorded: where each step's time went, from profiler traces."""
