"""barlow_twins: being written (issue 3)."""
