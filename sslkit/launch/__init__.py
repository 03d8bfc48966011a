"""Launching a run: the CLI, worker processes, SLURM, the run folder, start-up checks, the catalog, doctor and audit."""
