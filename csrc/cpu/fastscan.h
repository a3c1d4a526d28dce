// Fast-scan of packed 1/2/3/4-bit codes: 7-bit lookup tables in SIMD registers (the FAISS PQ
// fast-scan idea applied to our scalar codebooks), then an exact float re-score of a shortlist,
// so the result has the meaning of lut_scan_ref (tqvec/ops/ref.py) within float rounding.
// Layouts:
//   packed    (n, rb)        uint8   rows as in kernels.h, rb = ceil(d*b/8), b in {1, 2, 3, 4}
//   blocked   (nb, fb, 32)   uint8   nb = ceil(n/32); blocked[j][p][t] = row[32j+t][p], rows
//                                    past n are zero. One 32-byte load = byte p of 32 rows.
//                                    row = the packed row for b in {1, 2, 4} (fb = rb); for b = 3
//                                    the pair-plane row below (fb = 3 ceil(d/8)).
// b = 3: 3-bit indices never fill a nibble, so each group of 8 coordinates (3 bytes, 4 pairs)
// is stored as byte 0 = hi(pair 0) | hi(pair 1) << 4, byte 1 = hi(pair 2) | hi(pair 3) << 4,
// byte 2 = lo(pair 0) | lo(pair 1) << 2 | lo(pair 2) << 4 | lo(pair 3) << 6, where pair p holds
// coordinates 2p, 2p+1, hi = (idx_2p >> 1) | (idx_2p+1 >> 1) << 2 and lo = (idx_2p & 1) |
// (idx_2p+1 & 1) << 1 — still exactly 3 bits per coordinate. A pair's 6 bits index a 64-entry
// table, looked up as four 16-entry shuffles on `hi` and two byte blends on the bits of `lo`.
//   qr        (nq, d)        float32 queries in the codes' (rotated) domain
//   centroids (2^b)          float32
//   mult, add (n)            float32 score_i = mult_i * <qr, c[idx_i]> + add_i (add may be -inf)
//   out_vals  (nq, k)        float32 best first, -inf where fewer than k finite scores
//   out_idx   (nq, k)        int64   row positions, -1 where missing
// For b in {1, 2, 4} every nibble of a row (bits [4m, 4m+4) of its stream) holds 4/b whole
// indices, so <qr, c[idx]> = sum_m T[m][nibble_m] with a 16-entry table per nibble position
// (b = 3: a 64-entry table per pair). T is quantized to 7 bits with one step `delta` for all
// positions (per-position offsets), summed with 16-bit lanes (pshufb lookups, flushed to 32
// bits every 256 bytes so nothing overflows) and
// the approximation error is bounded (see build_lut: the worst case delta * M / 2 for small M,
// else a Hoeffding bound that fails with probability < 1e-9 per row). A row can only be in the
// top k if its upper bound reaches the k-th best lower bound seen so far; those rows (typically
// a few k) are re-scored exactly with the float table.
//
// With AVX-512 VNNI, batched exact scans of 4-bit codes score groups of 8 queries by int8 dot
// products of the decoded levels and the rounded query instead (fastscan/dot.h), with their own
// bound: the same re-scored top k.
//
// The implementation, by concern, in fastscan/: tables (the per-query lookup tables),
// shortlist (candidates and their selection), block_sums (the SIMD table sums and the scans
// that admit rows), schedule (the threads), and the scans: flat, terms, two_stage, ivf.
#pragma once
#include "kernels.h"
