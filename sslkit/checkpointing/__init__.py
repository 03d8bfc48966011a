"""How checkpoints are stored beneath sslkit/checkpoint.py: sharded DCP folders (sharded.py)."""
