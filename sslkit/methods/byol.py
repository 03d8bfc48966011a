"""byol: being written (issue 3)."""
