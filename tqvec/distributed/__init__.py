"""Scale-out on Ray: encode a collection in parallel, and search it as one index kept in
shards by Ray actors, merged exactly (``tqvec.index.merge_candidates``).

Train once on a sample (only what trains: IVF centroids, ``Center,``, ``PCA,``), broadcast
the trained empty index, let each shard's actor encode and add its part of the rows, and
search by scatter-gather. Shards are ordinary index files (``write_index``), memory-mapped
by their actors after ``save``/``load``. Install with ``pip install 'tqvec[ray]'``.
"""

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised without ray installed
    raise ImportError("tqvec.distributed needs Ray: pip install 'tqvec[ray]' (ray[data] "
                      "and pyarrow)") from e

from .encode import as_dataset, encode_dataset
from .errors import ShardError
from .sharded import ShardedIndex, build_sharded_index

__all__ = ["encode_dataset", "as_dataset", "build_sharded_index", "ShardedIndex", "ShardError"]
