"""An index's stored rows: codes, ids, the refinement's rows and named per-row arrays, kept in
add order and changed together."""

from __future__ import annotations

from typing import Any

import torch

from .. import _validate as V
from ..codecs.base import Codes, concat_codes

__all__ = ["Rows"]


def _concat(old: Codes | torch.Tensor | None, new: Codes | torch.Tensor
            ) -> Codes | torch.Tensor:
    if old is None:
        return new
    return concat_codes([old, new]) if isinstance(new, Codes) else torch.cat([old, new])


class Rows:
    """Rows in add order: ``codes`` (``Codes`` or None while empty), ``ids`` (int64, host),
    ``ref`` (the refinement's codes or exact vectors, or None) and ``per_row`` (name -> (n,)
    tensor of an estimator's per-row terms or list numbers; an empty tensor stands for a term
    the index does not use). ``next_id`` is what ``add`` numbers from (faiss's ``IndexIDMap2``:
    one past the largest id). Not thread-safe: the index serializes changes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.next_id = 0
        self.codes: Codes | None = None
        self.ref: Codes | torch.Tensor | None = None
        self.ids = torch.empty(0, dtype=torch.int64)
        self.per_row: dict[str, torch.Tensor] = {}
        self._pos: dict[int, int] | None = None

    def snapshot(self) -> Rows:
        """A copy that later appends and removals leave as it is (they replace arrays, never
        change them in place)."""
        out = Rows.__new__(Rows)
        out.__dict__.update(self.__dict__)
        out.per_row = dict(self.per_row)
        return out

    def append(self, codes: Codes, ids: torch.Tensor, ref: Any,
               per_row: dict[str, torch.Tensor]) -> None:
        """Add rows: their codes, ids, refinement rows (or None) and per-row terms."""
        self.codes = _concat(self.codes, codes)
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
        self.codes = self.codes[keep.to(self.codes.device)]
        if self.ref is not None:
            self.ref = self.ref[keep.to(self.ref.device)]
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
