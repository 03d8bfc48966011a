"""dino: being written (issue 3)."""
