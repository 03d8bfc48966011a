"""simsiam: being written (issue 3)."""
