"""What runs inside a shard actor: one or more shards (indexes), each from the broadcast
trained empty index or from its file, with a generation that counts the changes made to it
since then. Every call names the generation the coordinator expects: a shard that Ray
restarted from its source after changes (the rows added since the last save) refuses to
answer instead of answering from fewer rows."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import ray
import torch

from ..errors import FormatError
from ..index.io import read_index, write_index
from ..index.state import index_from_state
from .encode import batch_vectors
from .errors import ShardError

__all__ = ["ANSWER", "SCANNED", "ShardHost", "file_sha256", "shard_file"]

#: One candidate of a shard's search answer: ``search_candidates``' three columns in one record,
#: so that a host's answer is one array (one buffer for Ray to move, not three per shard).
ANSWER = np.dtype([("scan", "<f4"), ("final", "<f4"), ("id", "<i8")])
#: One candidate of a shard's first-round answer (``scan_candidates``' three columns).
SCANNED = np.dtype([("scan", "<f4"), ("pos", "<i8"), ("id", "<i8")])


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def shard_file(shard: int) -> str:
    return f"shard-{shard:05d}.tqi"


class ShardHost:
    """The body of a shard actor (``tqvec.distributed.sharded`` makes it a Ray actor).

    sources: shard number -> ``{"state": (meta, arrays)}`` (the trained empty index) or
    ``{"file": path, "sha256": hex, "mmap": bool}``. threads: torch's (and so the kernels')
    threads in this actor.
    """

    def __init__(self, sources: dict[int, dict[str, Any]], threads: int):
        torch.set_num_threads(max(1, int(threads)))
        self.shards: dict[int, Any] = {}
        self.generation: dict[int, int] = {}
        self.origin: dict[int, str] = {}
        for shard, src in sources.items():
            if "state" in src:
                state = src["state"]
                meta, arrays = ray.get(state) if isinstance(state, ray.ObjectRef) else state
                # Ray hands numpy arrays over read-only from its object store
                index = index_from_state(meta, {k: np.array(v) for k, v in arrays.items()},
                                         None, f"shard {shard}")
                self.origin[shard] = "the trained empty index (it was never saved)"
            else:
                path = src["file"]
                if src.get("sha256") and file_sha256(path) != src["sha256"]:
                    raise FormatError(f"{path!r} is not the file the manifest names for shard "
                                      f"{shard} (sha256 differs)")
                index = read_index(path, mmap=bool(src.get("mmap")))
                self.origin[shard] = f"its file {path!r}"
            self.shards[shard] = index
            self.generation[shard] = 0

    def _index(self, shard: int, generation: int) -> Any:
        if self.generation[shard] > generation:
            raise ShardError(f"shard {shard} holds changes its coordinator does not know of "
                             f"(generation {self.generation[shard]}, expected {generation}): "
                             f"two ShardedIndex objects changed it", [shard])
        if self.generation[shard] != generation:
            raise ShardError(
                f"shard {shard} was restarted from {self.origin[shard]} and lost "
                f"{generation - self.generation[shard]} change(s) made since; save() the "
                f"index after changes so that a restart recovers them", [shard])
        return self.shards[shard]

    def _changed(self, shard: int) -> int:
        self.generation[shard] += 1
        return self.generation[shard]

    # -- rows -------------------------------------------------------------------------------
    def add(self, shard: int, generation: int, x: np.ndarray, ids: np.ndarray
            ) -> tuple[int, int, int]:
        """(ntotal, next_id, generation) after adding x with ids."""
        index = self._index(shard, generation)
        index.add_with_ids(x, ids)
        return index.ntotal, index.next_id, self._changed(shard)

    def add_from(self, shard: int, generation: int, rows: Any, column: str, id_column: str,
                 batch_size: int) -> tuple[int, int, int]:
        """Add every batch of a Ray ``DataIterator`` (a ``streaming_split`` part)."""
        index = self._index(shard, generation)
        for batch in rows.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
            if id_column not in batch.column_names:
                raise ValueError(f"id_column must name the ids' column, got {id_column!r}; "
                                 f"the data has {sorted(batch.column_names)}")
            ids = batch.column(id_column).to_numpy()
            index.add_with_ids(batch_vectors(batch, column, index.d), ids)
        return index.ntotal, index.next_id, self._changed(shard)

    def remove(self, generations: dict[int, int], ids: np.ndarray
               ) -> dict[int, tuple[int, int, int]]:
        """shard -> (removed, ntotal, generation)."""
        ids = np.require(ids, np.int64, ["C", "W"])
        out = {}
        for shard, gen in generations.items():
            index = self._index(shard, gen)
            removed = index.remove_ids(ids)
            out[shard] = (removed, index.ntotal, self._changed(shard) if removed else gen)
        return out

    def reconstruct(self, generations: dict[int, int], key: int) -> np.ndarray | None:
        for shard, gen in generations.items():
            try:
                return self._index(shard, gen).reconstruct(key)
            except KeyError:
                continue
        return None

    # -- search ------------------------------------------------------------------------------
    def search(self, generations: dict[int, int],
               request: tuple[np.ndarray, int, Any, int, Any]) -> np.ndarray:
        """The ``search_candidates`` of the shards in ``generations`` for ``request`` = (x, k,
        allowed, rows, probes) - one argument for all hosts, which Ray moves at a fraction of
        the cost of five -, as one ``ANSWER`` array (shards in the order of ``generations``,
        nq, kk): records past a shard's own columns (an empty shard has none) are -inf / -1,
        which the merge leaves out. ``probes``: an IVF index's lists for x, probed once by the
        coordinator."""
        return self._candidates(generations, request, "search_candidates", ANSWER)

    def scan(self, generations: dict[int, int],
             request: tuple[np.ndarray, int, Any, int, Any]) -> np.ndarray:
        """Round one of a search that re-ranks after the merge: the shards'
        ``scan_candidates`` for ``request`` (as ``search``'s), one ``SCANNED`` array (shards,
        nq, kk), padded as ``search`` pads."""
        return self._candidates(generations, request, "scan_candidates", SCANNED)

    def refine(self, generations: dict[int, int], request: tuple[np.ndarray, ...],
               positions: np.ndarray) -> np.ndarray:
        """Round two: ``refine_candidates`` of ``positions[j]`` (nq, m) in the j-th shard of
        ``generations`` for the queries of ``request`` (round one's), (shards, nq, m) float32
        (-inf where a position is -1)."""
        x = np.require(request[0], np.float32, ["C", "W"])
        out = np.full(positions.shape, -np.inf, np.float32)
        for j, (shard, gen) in enumerate(generations.items()):
            index = self._index(shard, gen)
            if index.ntotal and positions.shape[2]:
                out[j] = index.refine_candidates(x, np.require(positions[j], np.int64, ["C"]))
        return out

    def _candidates(self, generations: dict[int, int], request: tuple, method: str,
                    dtype: np.dtype) -> np.ndarray:
        x, k, allowed, rows, probes = request
        x = np.require(x, np.float32, ["C", "W"])  # Ray hands arrays over read-only
        if allowed is not None:
            allowed = np.require(allowed, np.int64, ["C", "W"])
        parts = []
        for shard, gen in generations.items():
            index = self._index(shard, gen)
            parts.append(getattr(index, method)(x, k, allowed_ids=allowed, rows=rows,
                                                probes=probes) if index.ntotal else None)
        kk = max((p[0].shape[1] for p in parts if p is not None), default=0)
        out = np.empty((len(parts), x.shape[0], kk), dtype)
        for name in dtype.names:  # -inf similarities, -1 positions and ids
            out[name] = -np.inf if out[name].dtype.kind == "f" else -1
        for j, p in enumerate(parts):
            if p is not None:
                m = p[0].shape[1]
                for name, a in zip(dtype.names, p, strict=True):
                    out[name][j, :, :m] = a
        return out

    def range_search(self, generations: dict[int, int], x: np.ndarray, radius: float
                     ) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return {shard: self._index(shard, gen).range_search(x, radius)
                for shard, gen in generations.items()}

    # -- state -------------------------------------------------------------------------------
    def set_param(self, name: str, value: Any) -> None:
        for index in self.shards.values():
            setattr(index, name, value)

    def info(self) -> dict[int, dict[str, int]]:
        return {s: {"ntotal": i.ntotal, "next_id": i.next_id,
                    "generation": self.generation[s], "memory_bytes": i.memory_bytes()}
                for s, i in self.shards.items()}

    def save(self, generations: dict[int, int], folder: str) -> dict[int, dict[str, Any]]:
        """Write each shard to ``folder``/shard-NNNNN.tqi: shard -> its manifest entry."""
        out = {}
        for shard, gen in generations.items():
            index = self._index(shard, gen)
            path = os.path.join(folder, shard_file(shard))
            write_index(index, path)
            out[shard] = {"shard": shard, "file": shard_file(shard),
                          "sha256": file_sha256(path), "ntotal": index.ntotal,
                          "bytes": os.path.getsize(path)}
        return out

    def pid(self) -> int:
        return os.getpid()
