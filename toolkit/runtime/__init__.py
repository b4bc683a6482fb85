"""Runtime: what a running job writes and reads in its job directory (the job record, heartbeats, stops, profiles, step metrics) and the process helpers its launchers use."""
