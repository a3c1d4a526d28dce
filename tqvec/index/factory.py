"""``index_factory(d, spec, metric)``: build an index from a faiss-style string.

Grammar: ``CODE[,Prefilter[(P)]][,Refine(CODE|Flat)]`` where CODE is one of

==================  =======================================================  ==================
spec                codec                                                    bytes / vector
==================  =======================================================  ==================
``TQ{b}``           TurboQuant mse, b = 1..8 bits/coordinate                 ceil(b d / 8) + 4
``TQ{b}u``          TurboQuant mse with EDEN's unbiased scale                ceil(b d / 8) + 6
``TQ{b}f``          TurboQuant mse with the least-squares (fitted) scale     ceil(b d / 8) + 4
``TQ{b}g``          TurboQuant mse on a uniform grid codebook (also          ceil(b d / 8) + 4
                    ``TQ{b}gu``, ``TQ{b}gf``): decoded without table gathers
``TQprod{b}``       TurboQuant prod, b-1 mse bits + 1 QJL bit/coordinate     ceil((b-1)d/8)+d/8+8
``QJL{m}``          QJL with m sign bits                                     ceil(m / 8) + 4
``Polar``           PolarQuant, level bits (4, 2, 2, 2)                      3.875 d / 8
``Polar{b1}-{b2}..``PolarQuant with the given level bits                     see PolarQuant
``Flat``            (refinement only) exact float32 vectors                  4 d
==================  =======================================================  ==================

``TQ2,Refine(TQ8)`` searches 2-bit codes and re-ranks 4k candidates with 8-bit codes
(``Refine(TQ8g)``: the same bytes on a uniform grid, re-scored faster on the CPU: affine
decoding instead of a codebook gather).
``TQ4,Prefilter`` (TurboQuant-mse at 2-4 bits, CPU) scans only the sign bits of the codes first
and re-scores with the full codes every row whose sign estimate, within 3 standard deviations of
its error, can reach the k-th best (``FlatIndex.prefilter_sigmas``; no extra bytes: the sign
plane is the top bit of each index). ``TQ4,Prefilter(10)`` keeps a fixed 10k rows instead
(``FlatIndex.prefilter``: faster where the data is far from isotropic, and it can lose recall
where it is not); ``TQ1,Prefilter(10)`` scans the codes of the first half of the coordinates
first (1-bit codes have no bounded pass).
``Center,`` in front (``Center,TQ2``) codes x - mu with mu the mean of the rows passed to
``train`` (a fit of one vector: the index then needs ``train``; see ``FlatIndex``'s ``center``);
for ip and cosine it stores 4 more bytes per vector (the exact <mu, x - mu> term).
``PCA,`` in front (``PCA,TQ2``, ``PCA,TQ2,Refine(Flat)``) builds a ``PCAIndex``: a fitted
PCA basis (``train`` first; the one index that learns more than a mean), then TurboQuant at
mixed widths (0-4 or 8 bits per component, chosen by the components' variances) in the bytes
of ``TQ{b}`` (ip / cosine included: their 4-byte centring term is counted);
``PCA,TQ2,Prefilter(10)`` scores the leading runs (90 % of the variance) first and re-scores
their best 10k rows with the whole codes.
``HNSW{M},`` in front (``HNSW16,TQ1,Refine(Flat)``, ``HNSW32,TQ2``) builds a ``GraphIndex``:
faiss's HNSW graph with each node's neighbours' TurboQuant-mse codes (1-4 bits) beside it,
searched best-first with ``efSearch`` candidates; ``Refine(Flat)`` scores each expanded node
exactly. Its layout adds 2 M (code bytes + 12) bytes per vector (see ``tqvec.index.graph``).
``IVF{nlist},`` in front (``IVF256,TQ4``, ``IVF256,TQ2,Refine(Flat)``) builds an ``IVFIndex``:
k-means lists (``train`` first), residual codes, ``nprobe`` lists searched; the bytes per vector
are those of the codes (plus nlist * d * 4 bytes of centroids per index; ip: 4 more bytes per
vector, the exact <c, x - c> term).
"""

from __future__ import annotations

import re
from typing import Any

from ..codecs import QJL, PolarQuant, TurboQuant
from ..codecs.base import Codec
from .flat import FlatIndex
from .graph import GraphIndex
from .ivf import IVFIndex
from .pca import PCAIndex

__all__ = ["index_factory", "parse_codec", "PREFILTER_SIGMAS"]

#: ``Prefilter``'s error bound, in standard deviations of the first pass's error (a true top-k
#: row at the k-th place is missed with probability ~0.13 % where that error is Gaussian; a
#: smaller bound is faster and can miss more: docs/search.md).
PREFILTER_SIGMAS = 3.0

_REFINE = re.compile(r"^(?P<base>[^,]+)(,(?P<first>Prefilter)(\((?P<pf>\d+)\))?)?"
                     r"(,Refine\((?P<ref>[^)]+)\))?$")


def parse_codec(d: int, spec: str, seed: int = 0) -> Codec | str:
    s = spec.strip()
    if m := re.fullmatch(r"TQ(\d)(g?)([uf]?)", s):
        return TurboQuant(d, int(m[1]), seed=seed,
                          scale={"": "norm", "u": "unbiased", "f": "fit"}[m[3]],
                          codebook="grid" if m[2] else "lloyd-max")
    if m := re.fullmatch(r"TQprod(\d)", s):
        return TurboQuant(d, int(m[1]), "prod", seed=seed)
    if m := re.fullmatch(r"QJL(\d+)", s):
        return QJL(d, int(m[1]), seed)
    if s == "Polar":
        return PolarQuant(d, seed=seed)
    if m := re.fullmatch(r"Polar(\d(?:-\d)*)", s):
        return PolarQuant(d, tuple(int(b) for b in m[1].split("-")), seed)
    if s == "Flat":
        return "flat"
    raise ValueError(f"index spec component must be one of TQ{{b}}, TQ{{b}}u, TQ{{b}}f, "
                     f"TQ{{b}}g[u|f], "
                     f"TQprod{{b}}, "
                     f"QJL{{m}}, Polar, "
                     f"Polar{{b1}}-{{b2}}..., Flat, got {spec!r}")


# faiss factory strings a faiss user may try, each with what to use in tqvec instead.
_FAISS_ONLY = [
    (r"(IVF\d+,)?Flat|IndexFlat.*", "tqvec stores compressed codes; for exact search use faiss's "
     "IndexFlat, or 'TQ8' (8 bits/coordinate, recall@10 ~0.99) or 'TQ2,Refine(Flat)' (codes, "
     "then exact re-ranking of 4k candidates)"),
    (r"(IVF\d+,)?SQ.*", "faiss's SQ types are trained (per-dimension ranges); "
     "the data-oblivious scalar codes here are 'TQ{b}', e.g. SQ8 -> 'TQ8', SQ4 -> 'TQ4'"),
    (r"(IVF\d+(_HNSW\d+)?,)?(PQ|OPQ|IVFPQ|RQ|LSQ|PRQ|PLSQ|ITQ).*", "product and additive "
     "quantizers are trained; at the same bytes use 'TQ{b}' (no training), 'Center,TQ{b}f' (one "
     "fitted mean) or 'PCA,TQ{b}' (a fitted basis, the best recall here)"),
    (r"HNSW\d+,(Flat|SQ.*|PQ.*)|HNSW\d+|HNSW\d+_.*", "the graph index here is "
     "'HNSW{M},TQ{b},Refine(Flat)' (TurboQuant codes at 1-4 bits navigate, exact vectors "
     "re-rank), e.g. 'HNSW16,TQ1,Refine(Flat)'"),
    (r"NSG.*|NNDescent.*", "the graph index here is 'HNSW{M},TQ{b},Refine(Flat)'; for search "
     "without a graph, 'IVF{nlist},TQ{b}' with index.nprobe"),
    (r"RR,.*|HR,.*", "tqvec's codecs already apply a seeded random rotation: drop the 'RR,' "
     "('RR,TQ4' is 'TQ4')"),
    (r"L2norm,.*", "normalise through the metric instead: index_factory(d, 'TQ4', 'cosine')"),
    (r"PCA(R|W)?\d+.*|OPQ\d+.*", "the fitted basis here is 'PCA,TQ{b}' (every component kept, "
     "bits per component chosen by variance)"),
    (r"LSH.*", "sign-bit codes with an unbiased estimator are 'QJL{m}' (m bits per vector)"),
    (r"RaBitQ.*|EDEN.*", "the closest data-oblivious code here is 'TQ{b}u' (unbiased scale) or "
     "'Center,TQ{b}f'"),
]


def _faiss_only(body: str) -> str | None:
    """What to use instead of a faiss-only factory string, or None."""
    for pattern, hint in _FAISS_ONLY:
        if re.fullmatch(pattern, body):
            return hint
    return None


def index_factory(d: int, spec: str, metric: Any = "l2", *, seed: int = 0,
                  k_factor: int = 4, device: Any = None
                  ) -> FlatIndex | IVFIndex | PCAIndex | GraphIndex:
    """Build an index from a factory string (see the module docstring); ``device="cuda"``
    keeps the codes on the GPU and searches them with the CUDA kernels."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str, got {type(spec).__name__}")
    body = spec.replace(" ", "")
    # faiss's IDMap wrapper adds add_with_ids, which every tqvec index has: accepted as is
    body = re.sub(r"^IDMap2?,", "", body)
    hint = _faiss_only(body)
    if hint:
        raise ValueError(f"spec {spec!r} is a faiss index type tqvec does not build: {hint}")
    if body.startswith("PCA,"):
        m = re.fullmatch(r"PCA,TQ(\d)(,Prefilter\((?P<pf>\d+)\))?(,Refine\((?P<ref>[^)]+)\))?",
                         body)
        if not m:
            raise ValueError(f"spec must look like 'PCA,TQ2', 'PCA,TQ2,Prefilter(10)' or "
                             f"'PCA,TQ2,Refine(Flat)' for a PCA index (no Center or IVF with "
                             f"it), got {spec!r}")
        if device is not None and str(device) != "cpu":
            raise ValueError(f"device must be 'cpu' for a PCA index, got {device!r}")
        ref = parse_codec(d, m["ref"], seed) if m["ref"] else None
        return PCAIndex(d, int(m[1]), metric, refine=ref, k_factor=k_factor,
                        prefilter=int(m["pf"] or 0), seed=seed)
    hnsw = re.match(r"HNSW(\d+),", body)
    if hnsw:
        m = re.fullmatch(r"HNSW(\d+),TQ(\d)(,Refine\((?P<ref>[^)]+)\))?", body)
        if not m:
            raise ValueError(f"spec must look like 'HNSW16,TQ1,Refine(Flat)' or 'HNSW32,TQ2' "
                             f"for a graph index (TurboQuant-mse codes, no Center, IVF or "
                             f"Prefilter with it), got {spec!r}")
        if device is not None and str(device) != "cpu":
            raise ValueError(f"device must be 'cpu' for a graph index, got {device!r}")
        ref = parse_codec(d, m["ref"], seed) if m["ref"] else None
        return GraphIndex(TurboQuant(d, int(m[2]), seed=seed), int(m[1]), metric, refine=ref,
                          k_factor=k_factor)
    center = body.startswith("Center,")
    if center:
        body = body[len("Center,"):]
    ivf = re.match(r"IVF(\d+),", body)
    if body.startswith("IVF") and not ivf:
        raise ValueError(f"spec must look like 'IVF1024,TQ4' for an IVF index, got {spec!r}")
    if ivf:
        body = body[ivf.end():]
    m = _REFINE.fullmatch(body)
    if not m:
        raise ValueError(f"spec must look like 'TQ4', 'TQ2,Refine(TQ8)', 'TQ4,Prefilter(10)' or "
                         f"'IVF1024,TQ4', got {spec!r}")
    base = parse_codec(d, m["base"], seed)
    if base == "flat":
        raise ValueError("spec must start with a codec (Flat is only a refinement), got "
                         f"{spec!r}")
    # The refinement shares the codes' seed: a TurboQuant refinement then has their rotation,
    # and the compiled searches rotate each query once for both (the two codes quantize the
    # same rotated coordinates; the refinement re-scores by its own code alone, so sharing
    # costs nothing). Indexes written with another refinement seed keep it (their params).
    ref = parse_codec(d, m["ref"], seed) if m["ref"] else None
    pf = int(m["pf"]) if m["pf"] else 0
    bounded = m["first"] is not None and m["pf"] is None
    if ivf:
        if center:
            raise ValueError(f"spec must not combine Center with IVF (the lists' residuals are "
                             f"already centred, each on its centroid), got {spec!r}")
        if pf or bounded:
            raise ValueError(f"spec must not combine IVF with Prefilter (the probed lists are "
                             f"scanned in full), got {spec!r}")
        return IVFIndex(base, int(ivf[1]), metric, refine=ref, k_factor=k_factor, seed=seed,
                        device=device)
    return FlatIndex(base, metric, refine=ref, k_factor=k_factor, prefilter=pf,
                     prefilter_sigmas=PREFILTER_SIGMAS if bounded else 0.0,
                     center="fit" if center else None, device=device)
