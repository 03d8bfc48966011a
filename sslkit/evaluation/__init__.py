"""Evaluation of trained encoders: the features they give, feature extraction and the weighted kNN classifier."""

from sslkit.evaluation.features import FeatureEncoder, extract_features, pixel_features
from sslkit.evaluation.knn import knn_class_scores, weighted_knn

__all__ = ["FeatureEncoder", "extract_features", "knn_class_scores", "pixel_features", "weighted_knn"]
