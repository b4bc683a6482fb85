"""Runtime: one training process and what it leaves in the job directory (heartbeats, stops, profiles, step metrics)."""
