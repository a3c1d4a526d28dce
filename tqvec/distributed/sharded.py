"""A search index kept in shards by Ray actors and searched by scatter-gather with an exact
merge: the coordinator (this object, in the caller's process) sends each call to the actors
holding the shards it concerns and merges what they answer. Identical results to one index
over all the rows (``tqvec.index.merge_candidates``) for flat, centred, IVF and PCA indexes,
with or without a refinement; a prefilter's first pass and a graph's traversal run within
each shard, so those merge the shards' own (approximate) answers (``exact`` says which).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .. import _validate as V
from ..errors import FormatError
from ..index.factory import index_factory
from ..index.graph import GraphIndex
from ..index.io import read_index, write_index
from ..index.ivf import IVFIndex
from ..index.merge import merge_candidates, merge_ranges, merge_refined, merge_scans
from ..index.metrics import metric_name
from ..index.state import index_state
from ..io import read_container, write_container
from .encode import as_dataset, batch_vectors
from .errors import ShardError
from .host import ShardHost, file_sha256, shard_file

__all__ = ["ShardedIndex", "build_sharded_index", "MANIFEST", "TEMPLATE", "TWO_ROUNDS_FROM"]

MANIFEST = "manifest.tqm"
TEMPLATE = "template.tqi"
_KIND = "sharded-index"
#: 2: the manifest holds the template's sha256 (``template``); 1 (read still): it did not
_FORMAT = 2
_META = {"format", "d", "metric", "num_shards", "next_id", "shards", "template"}
_ENTRY = {"shard", "file", "sha256", "ntotal", "bytes"}
#: Query arrays above this many bytes go to the object store once for all actors.
_INLINE_BYTES = 64 * 1024
_PARAMS = ("nprobe", "prefilter", "k_factor", "efSearch")
#: ``refine_rounds`` None re-ranks after the merge once the re-ranking round one would repeat
#: reaches this many rows: batches on several shards, never a single query. Round two costs
#: more than its round trip (every shard prepares the queries again for the refinement and
#: re-ranks outside its one-call search), so the threshold is where bench/distributed.py saw
#: two rounds start to win (docs/distributed.md).
TWO_ROUNDS_FROM = 65536


def _has(index: Any, name: str) -> bool:
    return hasattr(type(index), name)


class ShardedIndex:
    """Shards of one index on Ray actors (module docstring). Build one with
    ``build_sharded_index`` or ``ShardedIndex.load``; faiss's surface: ``search``,
    ``range_search``, ``add``/``add_with_ids``, ``remove_ids``, ``reconstruct``, ``ntotal``,
    ``d``, ``metric_type``, and the query-time parameters of the index type (``nprobe``,
    ``prefilter``, ``k_factor``, ``efSearch``), forwarded to every shard."""

    def __init__(self, template: Any, sources: dict[int, dict[str, Any]], *,
                 num_actors: int | None = None, threads: int | None = None,
                 max_restarts: int = 3, max_task_retries: int = 2, next_id: int = 0):
        self._template = template
        self.d = template.d
        self.metric_type = template.metric_type
        self.num_shards = len(sources)
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        n_act = min(self.num_shards, V.positive_int(num_actors, "num_actors", 1)
                    if num_actors is not None else cpus)
        self._threads = (V.positive_int(threads, "threads", 1) if threads is not None
                         else max(1, cpus // n_act))
        self._restarts = (V.positive_int(max_restarts, "max_restarts", 0),
                          V.positive_int(max_task_retries, "max_task_retries", 0))
        self._placement = [s % n_act for s in range(self.num_shards)]
        self._sources = sources  # keeps the broadcast state alive for restarts
        self._hosts = self._start(sources, n_act)
        self._gen = [0] * self.num_shards
        self._sizes = [0] * self.num_shards
        self._next_id = next_id
        self._sync()

    def _start(self, sources: dict[int, dict[str, Any]], n_act: int) -> list[Any]:
        """One actor per host, holding the shards placed on it (several shards per actor run
        their calls on threads: a streaming split must be consumed by every part at once),
        the hosts dealt round-robin to the nodes with CPUs (soft: a restart may land on
        another node)."""
        actor = ray.remote(max_restarts=self._restarts[0],
                           max_task_retries=self._restarts[1])(ShardHost)
        nodes = sorted(n["NodeID"] for n in ray.nodes()
                       if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0)
        hosts = []
        for h in range(n_act):
            where = (NodeAffinitySchedulingStrategy(nodes[h % len(nodes)], soft=True)
                     if nodes else "DEFAULT")
            hosts.append(actor.options(max_concurrency=len(self._shards_of(h)) + 1,
                                       scheduling_strategy=where).remote(
                {s: sources[s] for s in self._shards_of(h)}, self._threads))
        return hosts

    # -- bookkeeping --------------------------------------------------------------------------
    def _shards_of(self, host: int) -> list[int]:
        return [s for s, h in enumerate(self._placement) if h == host]

    def _gens(self, host: int) -> dict[int, int]:
        return {s: self._gen[s] for s in self._shards_of(host)}

    def _gather(self, refs: list[Any], partial: bool = False,
                shards: list[list[int]] | None = None) -> tuple[list[Any], list[int]]:
        """ray.get each answer (ref i from the host i, or concerning ``shards[i]``); one that
        failed raises ``ShardError`` naming its shards (or, with ``partial``, is left out:
        (answers, None for those, the shards that answered))."""
        out: list[Any] = []
        failed: list[int] = []
        errors = []
        for i, ref in enumerate(refs):
            which = self._shards_of(i) if shards is None else shards[i]
            try:
                out.append(ray.get(ref))
            except ShardError as e:
                out.append(None)
                failed += which
                errors.append(str(e))
            except ray.exceptions.RayActorError as e:
                out.append(None)
                failed += which
                errors.append(f"shards {which}: their actor died and could not be restarted "
                              f"({type(e).__name__})")
        if failed and not partial:
            raise ShardError("; ".join(errors), failed)
        answered = [s for s in range(self.num_shards) if s not in failed]
        return out, answered

    def _sync(self) -> None:
        infos, _ = self._gather([h.info.remote() for h in self._hosts])
        for info in infos:
            for s, v in info.items():
                self._sizes[s] = v["ntotal"]
                self._next_id = max(self._next_id, v["next_id"])

    def actors(self) -> list[Any]:
        """The actor handles, one per host (shard s lives on ``actors()[shard_actor(s)]``)."""
        return list(self._hosts)

    def shard_actor(self, shard: int) -> int:
        return self._placement[V.positive_int(shard, "shard", 0, self.num_shards - 1)]

    @property
    def ntotal(self) -> int:
        return sum(self._sizes)

    @property
    def shard_sizes(self) -> list[int]:
        return list(self._sizes)

    @property
    def is_trained(self) -> bool:
        return True

    @property
    def exact(self) -> bool:
        """Whether ``search`` returns exactly one index's result (no prefilter, not a graph)."""
        return not (isinstance(self._template, GraphIndex)
                    or getattr(self._template, "prefilter", 0))

    def memory_bytes(self) -> int:
        infos, _ = self._gather([h.info.remote() for h in self._hosts])
        return sum(v["memory_bytes"] for info in infos for v in info.values())

    # -- parameters ----------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name in _PARAMS and _has(self.__dict__.get("_template"), name):
            return getattr(self._template, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PARAMS:
            if not _has(self._template, name):
                raise AttributeError(f"{name} is not a parameter of this index type "
                                     f"({type(self._template).__name__})")
            setattr(self._template, name, value)  # checks the value
            value = getattr(self._template, name)
            self._gather([h.set_param.remote(name, value) for h in self._hosts])
            return
        object.__setattr__(self, name, value)

    # -- rows ----------------------------------------------------------------------------------
    def add(self, x: Any) -> None:
        """Add rows with ids ntotal-style: from one past the largest id of every shard."""
        t, _ = V.float_matrix(x, "x", self.d)
        self.add_with_ids(t, np.arange(self._next_id, self._next_id + t.shape[0]))

    def add_with_ids(self, x: Any, ids: Any) -> None:
        """Add rows with ids to the shard that holds the fewest rows (one call)."""
        t, _ = V.float_matrix(x, "x", self.d)
        a = V.row_ids(ids, t.shape[0])
        if t.shape[0] == 0:
            return
        s = int(np.argmin(self._sizes))
        h = self._placement[s]
        (res,), _ = self._gather([self._hosts[h].add.remote(
            s, self._gen[s], t.to(torch.float32).numpy(), a)])
        self._sizes[s], nid, self._gen[s] = res
        self._next_id = max(self._next_id, nid)

    def add_dataset(self, data: Any, *, column: str = "emb", id_column: str = "id",
                    batch_size: int = 8192) -> None:
        """Add the rows of a Ray Dataset (or anything ``as_dataset`` takes: an array's rows
        get ids 0..n-1) in parallel: a ``streaming_split`` into one part per shard, each
        encoded and added by the shard's actor (the vectors in ``column``, ids in
        ``id_column``)."""
        batch_size = V.positive_int(batch_size, "batch_size", 1)
        ds = as_dataset(data, column, id_column=id_column, consumers=self.num_shards)
        parts = ds.streaming_split(self.num_shards, equal=False)
        refs = [self._hosts[self._placement[s]].add_from.remote(
            s, self._gen[s], parts[s], column, id_column, batch_size)
            for s in range(self.num_shards)]
        results, _ = self._gather(refs, shards=[[s] for s in range(self.num_shards)])
        for s, (n, nid, gen) in enumerate(results):
            self._sizes[s], self._gen[s] = n, gen
            self._next_id = max(self._next_id, nid)

    def remove_ids(self, ids: Any) -> int:
        sel = V.id_array(ids)
        outs, _ = self._gather([h.remove.remote(self._gens(i), sel)
                                for i, h in enumerate(self._hosts)])
        removed = 0
        for out in outs:
            for s, (r, n, g) in out.items():
                removed += r
                self._sizes[s], self._gen[s] = n, g
        return removed

    def reconstruct(self, key: int) -> np.ndarray:
        key = V.id_scalar(key)
        outs, _ = self._gather([h.reconstruct.remote(self._gens(i), key)
                                for i, h in enumerate(self._hosts)])
        for v in outs:
            if v is not None:
                return v
        raise KeyError(f"id {key} is not in the index")

    # -- search --------------------------------------------------------------------------------
    def _queries(self, x: Any) -> np.ndarray:
        return V.query_rows(x, "x", self.d, torch.device("cpu")).numpy()

    @property
    def refine_rounds(self) -> int | None:
        """Where a search under a refinement re-ranks: 1 - each shard re-ranks its own best
        candidates (one round trip; the re-ranking repeats in every shard), 2 - the shards
        scan, the coordinator merges their scans and each shard re-ranks only its rows among
        the best (one more round trip; the re-ranking of one index), None (default) - 2 once
        the re-ranking that round one would repeat (queries x candidates x (shards - 1))
        reaches ``TWO_ROUNDS_FROM`` rows. The same results either way."""
        return self.__dict__.get("_refine_rounds")

    @refine_rounds.setter
    def refine_rounds(self, value: int | None) -> None:
        if value is not None:
            value = V.positive_int(value, "refine_rounds", 1, 2)
        self.__dict__["_refine_rounds"] = value

    def _rounds(self, nq: int, candidates: int) -> int:
        if getattr(self._template, "refine", None) is None or not self.exact:
            return 1  # nothing to re-rank, or each shard's own first pass (not exact)
        if self.refine_rounds is not None:
            return self.refine_rounds
        shards = sum(1 for n in self._sizes if n)
        return 2 if nq * candidates * (shards - 1) >= TWO_ROUNDS_FROM else 1

    def search(self, x: Any, k: int, *, allowed_ids: Any = None, partial: bool = False
               ) -> Any:
        """``(D, I)`` as one index over all the shards' rows returns it (``exact``). With
        ``partial=True`` a shard that cannot answer is left out instead of raising
        ``ShardError``, and the result is ``(D, I, answered)``: the shard numbers that
        answered. Under a refinement, ``refine_rounds`` says where it re-ranks."""
        k = V.search_k(k, self.ntotal)
        local = self._queries(x)
        nq = local.shape[0]
        allowed = None if allowed_ids is None else V.id_array(allowed_ids, "allowed_ids")
        n = self.ntotal
        probes = None
        if isinstance(self._template, IVFIndex):  # probed once, here (faiss's IndexShardsIVF)
            probes = self._template.probe(local)
        request = _shared((local, k, allowed, n, probes), local, allowed, *(probes or ()))
        refined = getattr(self._template, "refine", None) is not None
        kf = getattr(self._template, "k_factor", 1)
        candidates = min(n, k * kf) if refined else k
        if self._rounds(nq, candidates) == 2:
            D, I, answered = self._search_two_rounds(request, nq, k, candidates, partial)
            return (D, I, np.array(answered, np.int64)) if partial else (D, I)
        outs, answered = self._gather([h.search.remote(self._gens(i), request)
                                       for i, h in enumerate(self._hosts)], partial)
        by_shard = {s: (a["scan"][j], a["final"][j], a["id"][j])
                    for i, a in enumerate(outs) if a is not None
                    for j, s in enumerate(self._shards_of(i))}
        parts = [by_shard[s] for s in sorted(by_shard)]
        if not parts:
            e = np.zeros((nq, 0), np.float32)
            parts = [(e, e, np.zeros((nq, 0), np.int64))]
        D, I = merge_candidates(parts, k, candidates, self.metric_type)
        return (D, I, np.array(answered, np.int64)) if partial else (D, I)

    def _search_two_rounds(self, request: Any, nq: int, k: int, candidates: int,
                           partial: bool) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``refine_rounds`` 2: the shards' scans merged (``merge_scans``), then each shard
        re-ranks its rows among the merged best, ranked by ``merge_refined``. With
        ``partial``, a shard that fails in the first round is left out as in one round; one
        that fails in the second leaves its candidates out of the merged best."""
        outs, _ = self._gather([h.scan.remote(self._gens(i), request)
                                for i, h in enumerate(self._hosts)], partial)
        by_shard = {s: (a["scan"][j], a["pos"][j], a["id"][j])
                    for i, a in enumerate(outs) if a is not None
                    for j, s in enumerate(self._shards_of(i))}
        shards = sorted(by_shard)
        if not shards:
            D, I = merge_refined(np.zeros((nq, 0), np.float32), np.zeros((nq, 0), np.int64),
                                 k, self.metric_type)
            return D, I, []
        part, pos, ids = merge_scans([by_shard[s] for s in shards], candidates)
        # each host gets, per shard of its own, that shard's merged candidates (columns in
        # merged order, this shard's first), padded with -1 to the host's widest
        asks, refs = [], []
        for i, h in enumerate(self._hosts):
            mine = [(j, shards.index(s)) for j, s in enumerate(self._shards_of(i))
                    if s in by_shard]
            if not mine:
                continue
            cols = [np.argsort(part != p, axis=1, kind="stable") for _, p in mine]
            m = max(int((part == p).sum(1).max()) for _, p in mine)
            if m == 0:  # none of its rows among the best: no second call
                continue
            positions = np.full((len(self._shards_of(i)), nq, m), -1, np.int64)
            for (j, p), c in zip(mine, cols, strict=True):
                c = c[:, :m]
                positions[j] = np.where(np.take_along_axis(part, c, 1) == p,
                                        np.take_along_axis(pos, c, 1), -1)
            asks.append((i, mine, cols, m, positions))
            refs.append(h.refine.remote(self._gens(i), request, positions))
        finals, _ = self._gather(refs, partial, shards=[self._shards_of(a[0]) for a in asks])
        final = np.full(part.shape, -np.inf, np.float32)
        failed = set()
        for (i, mine, cols, m, positions), got in zip(asks, finals, strict=True):
            if got is None:
                failed.update(self._shards_of(i))
                continue
            for (j, _), c in zip(mine, cols, strict=True):
                r, col = np.nonzero(positions[j] >= 0)
                final[r, c[:, :m][r, col]] = got[j][r, col]
        D, I = merge_refined(final, ids, k, self.metric_type)
        return D, I, [s for s in shards if s not in failed]

    def range_search(self, x: Any, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """faiss's ``(lims, D, I)``: every shard's results, in shard order."""
        radius = V.finite_float(radius, "radius")
        q = self._queries(x)
        q = _shared(q, q)  # once for all hosts
        outs, _ = self._gather([h.range_search.remote(self._gens(i), q, radius)
                                for i, h in enumerate(self._hosts)])
        by_shard = {s: r for out in outs for s, r in out.items()}
        return merge_ranges([by_shard[s] for s in sorted(by_shard)])

    # -- files ---------------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike) -> None:
        """Write each shard with ``write_index`` (by its actor) and a manifest naming each
        file and its sha256 (atomic, checksummed) into ``folder`` - a directory every actor
        and the caller can reach (local, or a shared file system). Then the actors serve the
        files, memory-mapped, so that a restarted actor recovers everything saved."""
        folder = os.fspath(folder)
        os.makedirs(folder, exist_ok=True)
        template = os.path.join(folder, TEMPLATE)
        write_index(self._template, template)
        outs, _ = self._gather([h.save.remote(self._gens(i), folder)
                                for i, h in enumerate(self._hosts)])
        entries = {s: e for out in outs for s, e in out.items()}
        # the template's hash too: its centroids / basis / codec must be the ones the shards
        # were coded with (a crash after the template's write leaves the old manifest, which
        # then refuses the new template)
        meta = {"format": _FORMAT, "d": self.d, "metric": metric_name(self.metric_type),
                "num_shards": self.num_shards, "next_id": self._next_id,
                "shards": [entries[s] for s in range(self.num_shards)],
                "template": {"file": TEMPLATE, "sha256": file_sha256(template)}}
        write_container(os.path.join(folder, MANIFEST), _KIND, meta, {})
        self._reopen(folder, [entries[s] for s in range(self.num_shards)], mmap=True)

    def _reopen(self, folder: str, entries: list[dict[str, Any]], mmap: bool) -> None:
        old = self._hosts
        self._sources = _file_sources(folder, entries, mmap)
        self._hosts = self._start(self._sources, len(old))
        for h in old:
            ray.kill(h)
        self._gen = [0] * self.num_shards
        self._sync()

    @classmethod
    def load(cls, folder: str | os.PathLike, *, mmap: bool = True, verify: bool = True,
             num_actors: int | None = None, threads: int | None = None,
             max_restarts: int = 3, max_task_retries: int = 2) -> ShardedIndex:
        """The index ``save`` wrote to ``folder``: one actor per shard (or ``num_actors``
        holding several each) reading its file (memory-mapped with ``mmap``) after checking
        its sha256 against the manifest (``verify``). A damaged or foreign manifest raises
        ``FormatError``."""
        folder = os.fspath(folder)
        meta, _, _ = read_container(os.path.join(folder, MANIFEST), _KIND)
        entries = _check_manifest(folder, meta)
        template_path = os.path.join(folder, TEMPLATE)
        want = meta.get("template", {}).get("sha256")  # format 1: not recorded
        if verify and want is not None and file_sha256(template_path) != want:
            raise FormatError(f"{folder!r}: the template index {TEMPLATE!r} is not the one the "
                              "shards were saved with (sha256 differs from the manifest's): a "
                              "save was interrupted, or the file was replaced")
        template = read_index(template_path)
        if template.d != meta["d"] or metric_name(template.metric_type) != meta["metric"]:
            raise FormatError(f"{folder!r}: the template index is d={template.d}, "
                              f"{metric_name(template.metric_type)}; the manifest says "
                              f"d={meta['d']}, {meta['metric']}")
        sources = _file_sources(folder, entries, mmap, verify)
        index = cls(template, sources, num_actors=num_actors, threads=threads,
                    max_restarts=max_restarts, max_task_retries=max_task_retries,
                    next_id=meta["next_id"])
        if index.shard_sizes != [e["ntotal"] for e in entries]:
            raise FormatError(f"{folder!r}: the shards hold {index.shard_sizes} rows, the "
                              f"manifest says {[e['ntotal'] for e in entries]}")
        return index

    def close(self) -> None:
        """Stop the actors (the index cannot be used after; its saved files stay)."""
        for h in self._hosts:
            ray.kill(h)
        self._hosts = []

    def __enter__(self) -> ShardedIndex:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ShardedIndex({type(self._template).__name__}, d={self.d}, "
                f"metric={metric_name(self.metric_type)!r}, shards={self.num_shards}, "
                f"actors={len(self._hosts)}, ntotal={self.ntotal})")


def _shared(value: Any, *arrays: np.ndarray | None) -> Any:
    """What an actor call sends: ``value``, or when its ``arrays`` exceed ``_INLINE_BYTES``
    a reference to it in the object store, put there once for all the actors called."""
    if sum(a.nbytes for a in arrays if a is not None) > _INLINE_BYTES:
        return ray.put(value)
    return value


def _file_sources(folder: str, entries: list[dict[str, Any]], mmap: bool,
                  verify: bool = False) -> dict[int, dict[str, Any]]:
    return {e["shard"]: {"file": os.path.join(os.path.abspath(folder), e["file"]),
                         "sha256": e["sha256"] if verify else None, "mmap": mmap}
            for e in entries}


def _check_manifest(folder: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's shard entries, every value checked (a file name is a plain name of the
    form save writes: nothing outside the folder is read)."""
    bad = FormatError
    fmt = meta.get("format")
    want = _META if fmt == _FORMAT else _META - {"template"}
    if fmt not in (1, _FORMAT) or set(meta) != want:
        raise bad(f"{folder!r} has a malformed or newer manifest: keys {sorted(meta)}, format "
                  f"{fmt!r} (expected {sorted(_META)}, format {_FORMAT})")
    if fmt == _FORMAT and (not isinstance(meta["template"], dict)
                           or set(meta["template"]) != {"file", "sha256"}
                           or meta["template"]["file"] != TEMPLATE
                           or not isinstance(meta["template"]["sha256"], str)):
        raise bad(f"{folder!r}: the manifest's template entry is malformed: "
                  f"{meta['template']!r:.200}")
    try:
        n = V.positive_int(meta["num_shards"], "num_shards", 1, 1 << 20)
        V.positive_int(meta["d"], "d", 1, V.MAX_DIM)
        V.positive_int(meta["next_id"], "next_id", 0, V.INT64_MAX)
    except (TypeError, ValueError) as e:
        raise bad(f"{folder!r} has a malformed manifest: {e}") from e
    shards = meta["shards"]
    if not isinstance(shards, list) or len(shards) != n:
        raise bad(f"{folder!r}: the manifest must list {n} shards")
    for s, e in enumerate(shards):
        if (not isinstance(e, dict) or set(e) != _ENTRY or e["shard"] != s
                or e["file"] != shard_file(s) or not isinstance(e["sha256"], str)
                or not isinstance(e["ntotal"], int) or e["ntotal"] < 0):
            raise bad(f"{folder!r}: manifest entry {s} is malformed: {e!r:.200}")
        if not os.path.isfile(os.path.join(folder, e["file"])):
            raise bad(f"{folder!r}: shard {s}'s file {e['file']!r} is missing")
    return shards


def build_sharded_index(data: Any, spec: str, metric: Any = "l2", *, column: str = "emb",
                        id_column: str | None = None, num_shards: int = 2,
                        train_rows: int = 100_000, seed: int = 0, k_factor: int = 4,
                        batch_size: int = 8192, num_actors: int | None = None,
                        threads: int | None = None, max_restarts: int = 3,
                        max_task_retries: int = 2) -> ShardedIndex:
    """A ``ShardedIndex`` of ``spec`` (an ``index_factory`` string) over ``data`` (a Ray
    Dataset, Parquet path(s), or an (n, d) array whose ids are 0..n-1): trained once on its
    first ``train_rows`` rows where the index trains, broadcast empty to ``num_shards``
    shards, each filled by its actor from a ``streaming_split`` part of the data (the vectors
    in ``column``, ids in ``id_column``, which a Dataset must name: it has no global row
    order to number its rows by). Until ``save``, a restarted actor cannot recover its rows
    (searches then raise ``ShardError``)."""
    array_input = isinstance(data, (np.ndarray, torch.Tensor))
    if id_column is None:
        if not array_input:
            raise ValueError("id_column must name the column of ids for a Ray Dataset or "
                             "Parquet input (a dataset has no global row order to number its "
                             "rows by); an array's rows get ids 0..n-1")
        id_column = "id"
    num_shards = V.positive_int(num_shards, "num_shards", 1, 1 << 20)
    train_rows = V.positive_int(train_rows, "train_rows", 1)
    if array_input:
        sample, _ = V.float_matrix(data[:train_rows], "data")
        sample = sample.to(torch.float32).numpy()
    else:
        first = as_dataset(data, column).limit(train_rows).take_batch(train_rows,
                                                                      batch_format="pyarrow")
        sample = batch_vectors(first, column)
    if sample.shape[0] == 0:
        raise ValueError("data must hold at least one row, got none")
    template = index_factory(sample.shape[1], spec, metric, seed=seed, k_factor=k_factor)
    if not template.is_trained:
        template.train(sample)
    state = ray.put(index_state(template))  # once for all actors
    sources = {s: {"state": state} for s in range(num_shards)}
    index = ShardedIndex(template, sources, num_actors=num_actors, threads=threads,
                         max_restarts=max_restarts, max_task_retries=max_task_retries)
    index.add_dataset(data, column=column, id_column=id_column, batch_size=batch_size)
    return index
