"""moco: being written (issue 3)."""
