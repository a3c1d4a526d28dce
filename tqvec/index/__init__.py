"""Search indexes over tqvec codes (faiss-compatible surface)."""

from .factory import index_factory
from .flat import METRIC_COSINE, METRIC_INNER_PRODUCT, METRIC_L2, FlatIndex
from .graph import GraphIndex
from .io import read_index, write_index
from .ivf import IVFIndex
from .merge import merge_candidates, merge_ranges, merge_refined, merge_scans
from .pca import PCAIndex, allocate_widths

__all__ = ["FlatIndex", "GraphIndex", "IVFIndex", "PCAIndex", "allocate_widths", "index_factory",
           "read_index", "write_index", "merge_candidates", "merge_ranges", "merge_refined",
           "merge_scans",
           "METRIC_INNER_PRODUCT", "METRIC_L2", "METRIC_COSINE"]
