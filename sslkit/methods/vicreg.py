"""vicreg: being written (issue 3)."""
