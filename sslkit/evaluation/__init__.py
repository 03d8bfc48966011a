"""Evaluation of frozen features: feature extraction and the weighted kNN classifier."""

from sslkit.evaluation.features import extract_features, pixel_features
from sslkit.evaluation.knn import knn_class_scores, weighted_knn

__all__ = ["extract_features", "knn_class_scores", "pixel_features", "weighted_knn"]
