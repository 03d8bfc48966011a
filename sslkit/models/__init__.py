"""Models: trunks, heads and the SSLModel that wires them (importing registers them)."""

from sslkit.models import heads, rope_vit, trunks, vit
from sslkit.models.heads import MLPHead
from sslkit.models.ssl_model import SSLModel, forward_views
from sslkit.models.trunks import SmallCNN, build_resnet

__all__ = ["MLPHead", "SSLModel", "SmallCNN", "build_resnet", "forward_views", "heads", "rope_vit", "trunks", "vit"]
