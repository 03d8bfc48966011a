"""swav: being written (issue 3)."""
