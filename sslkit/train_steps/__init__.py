"""Train steps: the stages a step is made of (stages.py), the standard step (standard.py), the sample dict."""
