"""What runs after training, on a run folder: the report and the visualisations."""
