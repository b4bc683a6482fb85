"""Planning: what a validated experiment will be (layout, placement, parameter counts, FLOPs, memory, communication), derived without starting a process."""
