"""What runs after training, on a run folder: knn, linear, extract (common.py), finetune, export, viz, report."""
