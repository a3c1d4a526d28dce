"""``to_faiss(index)``: the same codes in a faiss index, where faiss has the quantizer natively.

faiss (>= 1.14) ships TurboQuant-mse as scalar-quantizer types ``QT_{1,2,3,4,8}bit_tqmse``
(factory ``SQtqmse{b}``, rotation ``RR,``/``HR,`` in front). Its quantizer is ours without the
per-vector norm: it codes a unit vector's coordinates against a per-coordinate codebook and
decodes to ``c[idx]``. So a tqvec ``TQ{b}`` index maps onto

    IndexPreTransform([L2norm (cosine only),] LinearTransform(Pi), IndexScalarQuantizer(tqmse b))

with three facts checked in ``tests/test_faiss_export.py``:

* the packed codes are bit-identical (same LSB-first packing), so they are copied, not re-encoded;
* faiss's built-in table is the Gaussian approximation N(0, 1/d) of the coordinate law
  (1 bit, d = 64: centroid sqrt(2 / (pi d)) = 0.09974, the exact Beta law gives 0.10013; at
  d = 64, 4 bits that moves 6 % of the coordinates to another cell). The table lives in the
  scalar quantizer's ``trained`` array (centroids, then thresholds), which faiss reads when it
  encodes and decodes and keeps in its files, so we write our exact Lloyd-Max table there and
  faiss then decodes exactly our reconstructions;
* the rotation Pi becomes a dense ``LinearTransform`` (d x d floats, what faiss's own ``RR,``
  stores too).

What faiss cannot hold: the norm, and tqvec's rescaling by it. faiss scores a unit vector's code
by <q, x_hat> (inner product) or ||q - x_hat||^2 (L2). tqvec's L2 estimator is the same
distance to the reconstruction, so an ``l2`` index over unit-norm vectors exports with the same
results. tqvec's ``ip`` and ``cosine`` divide by ||x_hat|| (see ``flat``): the per-row factor
||x_hat|| varies by ~sqrt(D), and that costs recall when neighbours' scores are close
(clustered data, d = 96, recall@10 at 2 / 4 / 8 bits: tqvec 0.32 / 0.72 / 0.97, faiss's own
``L2norm,RR,SQtqmse{b}`` 0.15 / 0.32 / 0.85; the export, at 4 bits, 0.38). So ``ip`` (unit
vectors) and ``cosine`` indexes export only on request, ``faiss_estimator=True``: the same codes
under faiss's estimator. Nothing else has
a faiss equivalent: the prod/QJL/Polar codecs, the unbiased scale, 5-7 bits, IVF residual codes
(not unit vectors), refinement by a finer code. ``Refine(Flat)`` maps to ``IndexRefine`` with
an exact flat index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..codecs.base import Codec, KernelForm
from .metrics import METRIC_COSINE, METRIC_INNER_PRODUCT, METRIC_L2, metric_name

if TYPE_CHECKING:
    from .flat import FlatIndex

__all__ = ["to_faiss", "FAISS_TQMSE_BITS"]

FAISS_TQMSE_BITS = (1, 2, 3, 4, 8)
# Stored norms within this of 1 count as unit vectors (float32 norms of normalized float32
# vectors are 1 within ~1e-6; float16 norms within 5e-4).
_UNIT_TOL = 1e-3


def _exportable_form(codec: Codec) -> KernelForm | None:
    """The codec's form where faiss's SQtqmse can hold its codes: one rotated-domain term at
    an SQtqmse width whose multiplier is the stored norm."""
    form = codec.kernel_form()
    if form is None or not form.multiplier_is_norm or form.bits not in FAISS_TQMSE_BITS:
        return None
    return form


def _check_exportable(index: FlatIndex, faiss_estimator: bool,
                      norms: np.ndarray | None) -> None:
    codec = index.codec
    if not _exportable_form(codec):
        raise ValueError(f"to_faiss() needs TurboQuant-mse codes with bits in "
                         f"{FAISS_TQMSE_BITS} (faiss's SQtqmse types, factory 'TQ{{b}}'), got "
                         f"{codec!r}")
    if index.refine is not None and index.refine != "flat":
        raise ValueError(f"to_faiss() can export refine='flat' (faiss IndexRefine) only; faiss "
                         f"has no refinement by a tqvec codec, got refine={index.refine!r}")
    if index.metric_type != METRIC_L2 and not faiss_estimator:
        raise ValueError(f"to_faiss() of a {metric_name(index.metric_type)!r} index needs "
                         f"faiss_estimator=True: faiss ranks by <q, x_hat> without tqvec's "
                         f"division by ||x_hat||, which loses recall (see "
                         f"tqvec.index.faiss_export); pass faiss_estimator=True to accept "
                         f"faiss's estimator on the same codes")
    if index.metric_type in (METRIC_INNER_PRODUCT, METRIC_L2) and norms is not None:
        lo, hi = float(norms.min()), float(norms.max())
        if lo < 1 - _UNIT_TOL or hi > 1 + _UNIT_TOL:
            raise ValueError(
                f"to_faiss() with metric {metric_name(index.metric_type)!r} needs unit-norm "
                f"vectors (faiss's SQtqmse stores no per-vector norm), got stored norms in "
                f"[{lo:.4g}, {hi:.4g}]; normalize the vectors before add, or use "
                f"metric='cosine'")
    return codec


def to_faiss(index: FlatIndex, *, faiss_estimator: bool = False) -> Any:
    """A faiss index holding the same codes (see the module docstring for what maps).

    Returns an ``IndexPreTransform`` (in ``IndexRefine`` for ``Refine(Flat)``, then in
    ``IndexIDMap2`` when the ids are not 0..ntotal-1 in order); ``faiss.write_index`` saves it
    with our codebook, and vectors added to it later are encoded with the same quantizer
    (without the norm, as faiss does). Raises ``ValueError`` for anything faiss cannot hold.
    """
    import faiss

    _, arrays = index.state()
    n = len(arrays["ids"])
    codec, form = index.codec, _exportable_form(index.codec)
    norm = arrays.get(f"codes.scalar.{form.multiplier_field}") if form else None
    _check_exportable(index, bool(faiss_estimator),
                      norm.astype(np.float32) if n and norm is not None else None)
    d, b = index.d, form.bits
    cosine = index.metric_type == METRIC_COSINE
    fmetric = faiss.METRIC_L2 if index.metric_type == METRIC_L2 else faiss.METRIC_INNER_PRODUCT

    sq = faiss.IndexScalarQuantizer(d, getattr(faiss.ScalarQuantizer, f"QT_{b}bit_tqmse"),
                                     fmetric)
    table = np.concatenate([codec.codebook.centroids, codec.codebook.thresholds])
    faiss.copy_array_to_vector(table.astype(np.float32), sq.sq.trained)
    sq.is_trained = True

    rot = faiss.LinearTransform(d, d, False)
    # codec.rotate maps rows x to Pi x, so rotating the identity gives Pi^T (rows Pi e_i).
    pi = codec.rotate(torch.eye(d, dtype=torch.float32)).T.contiguous().numpy()
    faiss.copy_array_to_vector(pi.ravel(), rot.A)
    rot.is_orthonormal = True
    rot.is_trained = True

    pre = faiss.IndexPreTransform(rot, sq)
    if cosine:
        norm = faiss.NormalizationTransform(d, 2.0)
        pre.prepend_transform(norm)

    codes = arrays.get("codes.payload")
    ids = arrays["ids"].copy()
    exact = arrays.get("refine.vectors")
    # faiss's wrappers must be built around empty indexes; the contents go in afterwards. (faiss's
    # Python layer keeps the sub-objects handed to these constructors alive.)
    out = pre
    flat: Any = None
    if index.refine == "flat":
        flat = faiss.IndexFlat(d, fmetric)
        if cosine:
            flat = faiss.IndexPreTransform(faiss.NormalizationTransform(d, 2.0), flat)
        out = faiss.IndexRefine(pre, flat)
        out.k_factor = float(index.k_factor)
    idmap = None
    if n and not np.array_equal(ids, np.arange(n, dtype=np.int64)):
        # Outermost: IndexRefine looks its candidates up by position in the flat index.
        idmap = faiss.IndexIDMap2(out)
    if n:
        sq.add_sa_codes(np.ascontiguousarray(codes))
        pre.ntotal = n
        if flat is not None:
            flat.add(np.ascontiguousarray(exact, dtype=np.float32))
            out.ntotal = n
        if idmap is not None:
            faiss.copy_array_to_vector(ids, idmap.id_map)
            idmap.ntotal = n
            idmap.construct_rev_map()
            out = idmap
    return out
