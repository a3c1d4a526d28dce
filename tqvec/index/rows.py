"""An index's stored rows: codes, ids, the refinement's rows and named per-row arrays, kept in
add order and changed together.

The codes' payload is held once. Row-major as added; once an index has laid the codes out for
its scan (the fast-scan kernels' blocked layout, which it must hold anyway), it ``release``s the
row-major copy of those rows, and the layout serves them (``PayloadSource``): ``codes_rows``
rebuilds just the rows asked for, ``codes`` all of them - for files, reconstructions, removals
and the routes that read row-major codes. Rows added later stay row-major until the next
layout takes them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .. import _validate as V
from ..codecs.base import Codes, concat_codes
from ..ops import pages

__all__ = ["Rows", "PayloadSource"]


class PayloadSource(Protocol):
    """Where released rows' payload lives: ``payload(i0, i1)`` gives rows [i0, i1) as the
    (i1 - i0, payload_bytes) uint8 row-major payload."""

    def payload(self, i0: int, i1: int) -> torch.Tensor: ...


def _concat(old: Codes | torch.Tensor | None, new: Codes | torch.Tensor
            ) -> Codes | torch.Tensor:
    if old is None:
        return new
    if isinstance(new, Codes):
        return concat_codes([old, new])
    # exact vectors, which a re-rank reads at random: kept on huge pages
    return pages.host_cat([old, new]) if new.device.type == "cpu" else torch.cat([old, new])


def _kept(ref: Codes | torch.Tensor, keep: torch.Tensor) -> Codes | torch.Tensor:
    """The rows of ref where keep is set (exact vectors on the CPU onto huge pages)."""
    if isinstance(ref, Codes) or ref.device.type != "cpu":
        return ref[keep.to(ref.device)]
    rows = torch.nonzero(keep).squeeze(1)
    return torch.index_select(ref, 0, rows,
                              out=pages.host_empty((len(rows), *ref.shape[1:]), ref.dtype))


class Rows:
    """Rows in add order: their codes (``codes``, ``codes_rows``), ``ids`` (int64, host),
    ``ref`` (the refinement's codes or exact vectors, or None) and ``per_row`` (name -> (n,)
    tensor of an estimator's per-row terms or list numbers; an empty tensor stands for a term
    the index does not use). ``next_id`` is what ``add`` numbers from (faiss's ``IndexIDMap2``:
    one past the largest id). Not thread-safe: the index serializes changes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.next_id = 0
        # the codes: rows [0, released) served by _source, rows [released, n) by _payload
        # (row-major); _scalars hold every row's, _params the codec's, _mapped the file that
        # memory-mapped rows read (Codes.source)
        self._payload: torch.Tensor | None = None
        self._scalars: dict[str, torch.Tensor] = {}
        self._params: dict[str, Any] = {}
        self._mapped: Any = None
        self._source: PayloadSource | None = None
        self.released = 0
        self.ref: Codes | torch.Tensor | None = None
        self.ids = torch.empty(0, dtype=torch.int64)
        self.per_row: dict[str, torch.Tensor] = {}
        self._pos: dict[int, int] | None = None

    def snapshot(self) -> Rows:
        """A copy that later appends and removals leave as it is (they replace arrays, never
        change them in place)."""
        out = Rows.__new__(Rows)
        out.__dict__.update(self.__dict__, per_row=dict(self.per_row),
                            _scalars=dict(self._scalars))
        return out

    # -- the codes ---------------------------------------------------------------------------
    @property
    def has_codes(self) -> bool:
        return self._payload is not None

    def codes_rows(self, i0: int, i1: int) -> Codes:
        """Rows [i0, i1) as row-major ``Codes`` (a view where they are held row-major)."""
        scalars = {k: v[i0:i1] for k, v in self._scalars.items()}
        r = self.released
        if i0 >= r:
            return Codes(self._payload[i0 - r:i1 - r], scalars, self._params, self._mapped)
        payload = self._source.payload(i0, min(i1, r))
        if i1 > r:
            payload = torch.cat([payload, self._payload[: i1 - r]])
        return Codes(payload, scalars, self._params)

    @property
    def codes(self) -> Codes | None:
        """Every row's ``Codes``, row-major (rebuilt from the layout for released rows)."""
        return None if self._payload is None else self.codes_rows(0, self.n)

    def scalar_codes(self) -> Codes:
        """Every row's scalars with an empty payload: what a codec's ``lut_terms`` reads for its
        terms' centroids and per-row scales without their codes."""
        empty = torch.empty((self.n, 0), dtype=torch.uint8, device=self._payload.device)
        return Codes(empty, self._scalars, self._params)

    def release(self, source: PayloadSource) -> None:
        """From now on ``source`` serves every current row's payload; the row-major copy goes."""
        p = self._payload  # a new empty tensor: a slice would keep the storage alive
        self._payload = torch.empty((0, p.shape[1]), dtype=p.dtype, device=p.device)
        self._source, self.released = source, self.n

    def materialize(self) -> None:
        """Hold every row row-major again (before removals, or where the layout goes)."""
        if self.released:
            self._payload = self.codes_rows(0, self.n).payload
            self._source, self.released = None, 0

    # -- changes ------------------------------------------------------------------------------
    def append(self, codes: Codes, ids: torch.Tensor, ref: Any,
               per_row: dict[str, torch.Tensor]) -> None:
        """Add rows: their codes, ids, refinement rows (or None) and per-row terms."""
        if self._payload is None:
            self._payload, self._scalars = codes.payload, dict(codes.scalars)
            self._params, self._mapped = dict(codes.params), codes.source
        else:
            if dict(codes.params) != self._params:
                raise ValueError(f"codes were encoded with {dict(codes.params)}, expected "
                                 f"{self._params}")
            self._payload = torch.cat([self._payload, codes.payload])
            self._scalars = {k: torch.cat([v, codes.scalars[k]]) for k, v in self._scalars.items()}
        if ref is not None:
            self.ref = _concat(self.ref, ref)
        for name, values in per_row.items():
            old = self.per_row.get(name)
            self.per_row[name] = values if old is None else torch.cat([old, values])
        self.ids = torch.cat([self.ids, ids])
        self.n += len(ids)
        if len(ids):
            self.next_id = max(self.next_id, int(ids.max()) + 1)
        self._pos = None

    def keep(self, keep: torch.Tensor) -> int:
        """Keep the rows where ``keep`` (n,) bool is set; returns how many went."""
        removed = int((~keep).sum())
        if not removed:
            return 0
        self.materialize()
        kd = keep.to(self._payload.device)
        self._payload = self._payload[kd]
        self._scalars = {k: v[kd] for k, v in self._scalars.items()}
        if self.ref is not None:
            self.ref = _kept(self.ref, keep)
        for name, values in self.per_row.items():
            if values.numel():
                self.per_row[name] = values[keep.to(values.device)]
        self.ids = self.ids[keep]
        self.n -= removed
        self._pos = None
        return removed

    def term(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """A per-row array (empty when the index keeps none of that name)."""
        t = self.per_row.get(name)
        if t is None:
            return torch.empty(0, dtype=torch.float32, device=device)
        return t

    def position(self, key: Any) -> int:
        """The row of id ``key`` (KeyError if absent)."""
        key = V.id_scalar(key)
        if self._pos is None:
            self._pos = {int(i): p for p, i in enumerate(self.ids.tolist())}
        if key not in self._pos:
            raise KeyError(f"id {key} is not in the index")
        return self._pos[key]
