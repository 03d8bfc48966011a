"""How checkpoints are stored: sharded DCP folders and what a checkpoint may unpickle."""
