// tqvec CPU kernels. Layouts (all row-major, C-contiguous, validated by the caller):
//   idx     (n, d)          uint8   one quantization index per coordinate, values < 2^b
//   packed  (n, row_bytes)  uint8   row_bytes = ceil(d*b/8); index j occupies bits [j*b, (j+1)*b)
//                                   of the row's bit stream, bit t of the stream is bit (t % 8) of
//                                   byte t / 8 (LSB-first); padding bits at the end are zero
//   y       (n, d)          float32 rotated vectors; scale (n) float32 multiplies row i first
//   thr     (K-1)           float32 ascending interior decision thresholds, K = 2^b
//   perms   (R, d)          int64   permutation of round r (forward: z_j = x_{perm[r][j]})
//   signs   (R, d)          float32 +-1 of round r
// Every kernel takes `nthreads` and splits rows across std::threads; none keeps global state.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "arch.h"
#include "cpu_features.h"

namespace tqvec {


void pack_bits(const uint8_t* idx, int64_t n, int64_t d, int b, uint8_t* out, int nthreads);
void unpack_bits(const uint8_t* packed, int64_t n, int64_t d, int b, uint8_t* out, int nthreads);
void quantize_pack(const float* y, const float* scale, int64_t n, int64_t d, const float* thr,
                   int b, uint8_t* out, int nthreads);
// Per row of b-bit packed codes (n, row_bytes(d, b)) with centroids c (2^b): csq = sum_j
// c[idx_j]^2 and, when y (n, d) and scale (n) are given, dot = sum_j (y_ij * scale_i) c[idx_j]
// (dot may then be null otherwise). The sums run in double, rounded to float32 once.
void centroid_stats(const uint8_t* packed, int64_t n, int64_t d, int b, const float* centroids,
                    const float* y, const float* scale, float* csq, float* dot, int nthreads);
// y (n, d) = centroids[idx] * mult[:, None] for b-bit packed codes (n, row_bytes(d, b)) and
// per-row multipliers mult (n): the rotated-domain reconstruction, one thread.
void dequantize_rows(const uint8_t* packed, const float* mult, int64_t n, int64_t d, int b,
                     const float* centroids, float* y);
void hadamard_rotate(const float* x, int64_t n, int64_t d, const int64_t* perms,
                     const float* signs, int rounds, int64_t p, bool inverse, float* out,
                     int nthreads);

// b-bit codes with the per-row terms of their scores, score_i = add_i + mult_i <qr, c[idx_i]>:
// n rows over d coordinates, centroids c (2^b), mult and add (n). `codes` is packed
// (n, ceil(d b / 8)) for the packed-layout kernels, blocked (ceil(n / 32), fs_row_bytes(d, b),
// 32) for the fast scans.
struct CodeTable {
  const uint8_t* codes;
  int64_t n, d;
  int b;
  const float* centroids;
  const float* mult;
  const float* add;
};
// A top-k result: per query the best k, (nq, k) values and row positions, best first, padded
// with -inf / -1.
struct TopKOut {
  int64_t k;
  float* vals;
  int64_t* idx;
  float* vals_of(int64_t qi) const { return vals + qi * k; }
  int64_t* idx_of(int64_t qi) const { return idx + qi * k; }
};

// The top k rows of packed codes t for each of nq queries qr (nq, t.d).
void lut_scan(const float* qr, int64_t nq, const CodeTable& t, const TopKOut& out, int nthreads);
// lut_scan's meaning over the listed rows only: query i scores rows[i, 0 .. r) (-1 = none;
// the second stage after a coarse scan), top k of them as row positions.
void lut_rescore(const float* qr, int64_t nq, const CodeTable& t, const int64_t* rows, int64_t r,
                 const TopKOut& out, int nthreads);

// Fast-scan (fastscan/): bytes per row of the blocked layout — the packed row for b in
// {1, 2, 4}, the pair layout of 3 bytes per 8 coordinates for b = 3 (see fastscan.h).
// min(a * b, cap) for a, b >= 1 without overflow: a candidate count (k * k_factor, prefilter *
// k) is at most the n rows there are, whatever a caller asked for.
inline int64_t capped_product(int64_t a, int64_t b, int64_t cap) {
  return a > cap / b ? cap : std::min(a * b, cap);
}

inline int64_t fs_row_bytes(int64_t d, int b) {
  return b == 3 ? 3 * ((d + 7) / 8) : (d * b + 7) / 8;
}
// packed (n, ceil(d b / 8)) rows -> blocks of 32 rows, byte-major (nb, fs_row_bytes, 32); any b
// is transposed as is, except b = 3, which is re-laid out in pairs.
void block_codes(const uint8_t* packed, int64_t n, int64_t d, int b, uint8_t* blocked,
                 int nthreads);
// block_codes of the gathered rows packed[rows[i]], i < n (rows[i] = -1: a zero row), without
// the gathered copy: a graph's neighbour lists laid out from the rows' codes.
void block_code_rows(const uint8_t* packed, const int32_t* rows, int64_t n, int64_t d, int b,
                     uint8_t* blocked, int nthreads);
// lut_scan's meaning over blocked codes t, b in {1, 2, 3, 4}; approx: the top k by the 8-bit
// table scores and those scores, no exact re-score (a first stage before a refinement).
void fast_scan(const float* qr, int64_t nq, const CodeTable& t, bool approx, const TopKOut& out,
               int nthreads);
// A sign-plane first pass bounded by its error (ops.fast_scan_two_stage_ref's bound): the
// pass's multipliers are (about) gain times the full codes', and a row's full score lies within
// |mult| (sigma ||q|| sin(q, row) / gain + the tables' error) of its pass score, the angle's
// cosine estimated by gain (score - add) / (mult cnorm ||q||), sin at least min_sin.
// sigma = 0: no bound.
struct SignBound {
  float sigma = 0.0f, gain = 1.0f, cnorm = 1.0f;
  float min_sin = 0.0f;  // the floor of sin (the cosine estimate's own resolution)
};
// Two stages: the approximate top k1 rows by the sign plane `signs` (blocked 1-bit codes of the
// top bit of each index of the first signs.d <= full.d coordinates, its 2 centroids, its own
// per-row multipliers and offsets), then the exact top k of those by their packed b-bit codes
// `full`; signs.add = -inf must hold wherever full.add = -inf. qr (nq, full.d).
// (1-bit codes: signs.d < d, a prefix of the coordinates is the coarse pass.)
// bound.sigma > 0 replaces the fixed k1 by an error bound (SignBound), and every row whose
// upper bound reaches the k-th best lower bound is re-scored (k1 is unused).
void fast_scan_two_stage(const float* qr, int64_t nq, const CodeTable& signs,
                         const CodeTable& full, int64_t k1, const TopKOut& out, int nthreads,
                         const SignBound& bound = {});
// fast_scan with several terms per row: score_i = add_i + sum_t mult_t[i] <qr_t, c_t[idx_t,i]>,
// each term with its own queries (nq, d_t), blocked codes (nb, fs_row_bytes(d_t, b_t), 32),
// width b_t in {1, 2, 3, 4}, 2^b_t centroids and (n) multipliers (e.g. TurboQuant-prod: the
// mse codes and the QJL signs with centroids -1, +1).
// nfirst > 0 makes it two-stage: the table scores of the first nfirst terms (add_i + their
// sum; no bound) pick the k1 best rows, which are re-scored exactly with every term from the
// terms' packed (n, ceil(d_t b_t / 8)) rows - a heuristic like fast_scan_two_stage (mixed-width
// codes: the leading runs hold most of the variance). nfirst = 0: exact, packed unused.
struct ScanTerm {
  const float* qr;
  int64_t d;
  const uint8_t* blocked;
  int b;
  const float* centroids;
  const float* mult;
  const uint8_t* packed;  // row-major codes (nfirst > 0), else may be null
};
void fast_scan_terms(const ScanTerm* terms, int nterms, int64_t nq, int64_t n, const float* add,
                     const TopKOut& out, int nthreads, int nfirst = 0, int64_t k1 = 0);
// fast_scan over inverted lists stored as consecutive block ranges of blocked codes t (rows
// past a list's end padded with add = -inf; t.n = 32 * blocks): list l is blocks
// list_blocks[l] .. list_blocks[l + 1] of nlist. Query i scans its probed lists
// probes.lists[i, :] (-1 = none), adding probes.offsets[i, r] to the scores of list
// probes.lists[i, r]; out.idx holds row positions of t. approx as fast_scan's.
struct Probes {
  const int64_t* lists;   // (nq, nprobe)
  const float* offsets;   // (nq, nprobe)
  int64_t nprobe;
};
void ivf_fast_scan(const float* qr, int64_t nq, const CodeTable& t, const int64_t* list_blocks,
                   int64_t nlist, const Probes& probes, bool approx, const TopKOut& out,
                   int nthreads);

// A proximity graph over b-bit codes (graph.cpp): per layer, each node's R neighbours (R a
// multiple of 32; -1 pads) with their codes in fast-scan blocks, so that one expansion scores
// all R with R / 32 block passes. Layer 0 holds every row (slot == nullptr: node = row); an
// upper layer holds some rows, slot[row] their node (-1 absent).
struct GraphLayer {
  int64_t nodes, degree;
  const int32_t* nbr;     // (nodes, R) neighbour rows
  const uint8_t* codes;   // (nodes, R / 32, fs_row_bytes(d, b), 32) their blocked codes
  const float* mult;      // (nodes, R) their score multipliers and offsets (the flat scan's
  const float* add;       // terms; add = -inf for padding)
  const int32_t* slot;    // (n) or nullptr
};
struct GraphArgs {
  const GraphLayer* layers;  // [0] the base layer, then upwards
  int nlayers;
  int64_t n, d;
  int b;
  const float* centroids;    // (2^b)
  int64_t entry;             // the row the search starts from, in the top layer
  // the entry's own code as one block (1, fs_row_bytes(d, b), 32) (the entry in slot 0), its
  // multiplier and offset (32; slots 1.. padding): the search starts from its estimate (a node
  // is otherwise scored only from its neighbours' lists, where the entry may be in none)
  const uint8_t* entry_codes;
  const float* entry_mult;
  const float* entry_add;
  const uint8_t* allowed;    // (n) 0 / 1: rows a result may be, or nullptr for all
  // (n, d) exact vectors, or nullptr: each expanded node is scored exactly by them
  // (rescore_similarity of exact_metric; its vector is read beside its neighbours' codes)
  const float* exact_x;
  int exact_metric;
};
// Per query qr (nq, d), rotated: greedy descent of the upper layers, then best-first search of
// layer 0 keeping the ef best estimates (8-bit table sums). out gets, best first (ties: the
// lower row), padded with -inf / -1: with exact_x the best out.k expanded nodes by their exact
// similarity to q (nq, d; the unrotated queries, and qsq (nq) their ||q||^2 for L2), else the
// best out.k (<= ef) estimates.
void graph_search(const GraphArgs& g, const float* qr, const float* q, const float* qsq,
                  int64_t nq, int64_t ef, const TopKOut& out, int nthreads);

// Decode attention over TurboQuant-mse key/value codes (attention.cpp; decode_attention_ref):
// softmax state (m, l, acc) per (KV head, query row), tokens [lo, hi) of T per head.
void decode_attention(const float* qr, const float* qbias, int64_t bh, int64_t g, int64_t d,
                      const uint8_t* kpacked, const float* knorm, const float* kcent, int kb,
                      const uint8_t* vpacked, const float* vnorm, const float* vcent, int vb,
                      int64_t t, const int32_t* lo, const int32_t* hi, float scale, float* m,
                      float* l, float* acc, int nthreads);

// out[i] = ||x_i||^2 of the n rows of x (n, d) float32 (rescore.cpp; row_sqnorms_ref): the
// ||q||^2 of an L2 search, one function for the one-call and the general path (same bits).
void row_sqnorms(const float* x, int64_t n, int64_t d, float* out);
// out[i] = <x_i, v> (rescore.cpp; row_dots_ref): a centred inner-product index's <q, mu>, one
// function for the one-call and the general path.
void row_dots(const float* x, int64_t n, int64_t d, const float* v, float* out);

// out (n, m) = x (n, d) W (d, m), float32, every entry summed over j = 0 .. d-1 in order by
// fused multiply-adds (rescore.cpp; row_project_ref): a PCA index's query map, one function for
// the one-call and the general path (same bits).
void row_project(const float* x, int64_t n, int64_t d, const float* W, int64_t m, float* out,
                 int nthreads);

// Exact re-ranking of candidates (rescore.cpp; rescore_topk_ref): query i's candidates
// j = rows[i, r] (-1 = none) of x (n, d) float32, scored by the metric's similarity
// kRescoreIP <q, x_j>, kRescoreL2 2 <q, x_j> - ||x_j||^2 - ||q||^2 (= -||q - x_j||^2),
// kRescoreCosine <q, x_j> / max(||x_j||, 1e-30); the best k first (ties: the earlier candidate)
// as (vals, idx = the rows), padded with -inf / -1.
enum RescoreMetric { kRescoreIP = 0, kRescoreL2 = 1, kRescoreCosine = 2 };
// <q, x> and ||x||^2 of one row (rescore_topk's float operations and vector path), and the
// metric's similarity from them (the reference's float operations, in its order).
void dot_and_sqnorm(const float* q, const float* x, int64_t d, float* dot, float* sqn);
inline float rescore_similarity(float dot, float sqn, float qsq, int metric) {
  return metric == kRescoreL2       ? 2.f * dot - sqn - qsq
         : metric == kRescoreCosine ? dot / std::max(std::sqrt(sqn), 1e-30f)
                                    : dot;
}
void rescore_topk(const float* q, int64_t nq, int64_t d, const float* x, const int64_t* rows,
                  int64_t kk, int metric, int64_t k, float* vals, int64_t* idx, int nthreads);
// The nprobe best lists per query: <q, c_l> (l2: 2 <q, c_l> - csq_l - ||q||^2), best first.
void ivf_probe(const float* q, int64_t nq, int64_t d, const float* c, int64_t nlist,
               const float* csq, bool l2, int64_t nprobe, int64_t* probes, float* offsets,
               int nthreads);


// A Hadamard rotation's parameters (hadamard_rotate's perms, signs, rounds, p), as the one-call
// searches take them.
struct RotationArgs {
  const int64_t* perms;
  const float* signs;
  int rounds;
  int64_t p;
};

// TurboQuant-mse codes of n float32 rows x (n, d) with their norms nrm (n): the rows rotated,
// scaled by 1 / norm and quantized against thr (2^b - 1) into packed (n, row_bytes(d, b));
// with fit non-null, each row's least-squares multiplier nrm <u, c> / ||c||^2 (encode.cpp).
void turbo_mse_encode(const float* x, const float* nrm, int64_t n, int64_t d,
                      const RotationArgs& rot, const float* thr, const float* centroids, int b,
                      uint8_t* packed, float* fit, int nthreads);

// The reconstruction of TurboQuant-mse codes (n, row_bytes(d, b)) with per-row multipliers mult
// (n): Pi^T (centroids[idx] * mult) into out (n, d) float32 (encode.cpp).
void turbo_mse_decode(const uint8_t* packed, const float* mult, int64_t n, int64_t d,
                      const RotationArgs& rot, const float* centroids, int b, float* out,
                      int nthreads);

// One decode step of attention over a layer's stored segments (attention.cpp; its meaning is
// the composition in tqvec/kv/attention.py, _attend_rows_kernel): code segments - keys and
// values as TurboQuant-mse codes - and full-precision segments, every token visible to every
// query row. A code segment's side (keys or values): packed b-bit codes (bh, t, ceil(d b / 8)),
// per-token multipliers as float16 bits (norm16) or as 8-bit codes looked up in norm_table (256
// floats), centroids (2^b), the codec's rotation, and an optional per-KV-head channel scale
// (mu, sc: (heads, d); the codes hold (x - mu) / sc). Tokens [lo, hi) of t count.
struct KVCodeSide {
  const uint8_t* packed;
  const uint16_t* norm16;
  const uint8_t* norm8;
  const float* norm_table;
  const float* cent;
  int b;
  RotationArgs rot;
  const float* mu;
  const float* sc;
};
struct KVCodeSegment {
  KVCodeSide key, value;
  int64_t t, lo, hi;
};
// Full-precision keys and values (bh, n, d) of dtype kF32, kBF16 or kF16.
enum : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
struct KVExact {
  const void* k;
  const void* v;
  int dtype;
  int64_t n;
};
// q (bh, g, d) float32 query rows (g per (batch, KV head); head = (row / g) % heads) ->
// out (bh, g, d) float32 attention outputs, softmax over all segments' scores times `scale`.
void attention_step(const float* q, int64_t bh, int64_t heads, int64_t g, int64_t d,
                    float scale, const KVCodeSegment* segs, int nseg, const KVExact* exact,
                    int nexact, float* out, int nthreads);

// A refinement by TurboQuant-mse codes (search.cpp's one-call searches): packed rows `codes`
// re-scored by lut_rescore of the query rotated by rot, with the index's refinement table terms.
// codes.codes == nullptr: none.
struct CodedRefine {
  CodeTable codes;
  RotationArgs rot;
  bool same_rotation;  // rot is the scan's: its rotated queries are re-used
};

// A whole flat search (search.cpp): rotate the queries (rot), fast_scan the blocked codes
// `scan` for the best min(k, n), or with a prefilter (full.codes != nullptr)
// fast_scan_two_stage (`scan` then is the sign plane, `full` the packed full codes, prefilter *
// kk rows kept); for l2 the score minus ||q_i||^2 by row_sqnorms; D, I (nq, k) as faiss returns
// them.
struct FlatSearchArgs {
  RotationArgs rot;
  CodeTable scan;         // n rows over d coordinates (with a prefilter: d1 <= d of them)
  CodeTable full;         // the packed full codes of a prefilter; codes == nullptr: one stage
  int64_t d;              // the queries' dimension
  int64_t prefilter;
  SignBound prefilter_bound;  // sigma > 0: fast_scan_two_stage's bounded pass (prefilter unused)
  const int64_t* ids;
  int metric;            // RescoreMetric of the index's scores
  const float* center;   // (d) subtracted from the queries (an L2 index's centring), or nullptr
  bool normalize;        // cosine: q / max(sqrt(row_sqnorms(q)), 1e-30) first
  // (d) or nullptr: row_dots(q, ip_center) added to each query's values (after normalize): a
  // centred inner-product index's <q, mu>
  const float* ip_center;
  // A refinement (prefilter 0): the scan keeps k_factor k candidates by its tables alone
  // (approx), then re-scores them — exact vectors ref_x (n, d) by rescore_topk, or the codes of
  // ref_codes. Neither: ref_x == ref_codes.codes.codes == nullptr.
  const float* ref_x;
  CodedRefine ref_codes;
  int64_t k_factor;
};
void flat_search(const FlatSearchArgs& a, const float* q, int64_t nq, int64_t k, float* D,
                 int64_t* I, int nthreads);

// A whole search of a flat index over several terms whose queries come from one product
// (search.cpp; PCA,TQ{b}): unit rows (normalize) or q - center, then t = q W (row_project),
// term x's queries the columns [cols[x], cols[x] + terms[x].d) of t; fast_scan_terms (nfirst
// > 0: two stages, prefilter * kk rows kept); for l2 the score minus ||q||^2 (row_sqnorms),
// plus <q, ip_center> where given; D, I (nq, k) as faiss returns them.
struct TermsSearchArgs {
  int64_t d, m, n;
  const float* W;               // (d, m)
  std::vector<ScanTerm> terms;  // their qr set by each search
  std::vector<int64_t> cols;
  const float* add;             // (n)
  int nfirst;
  int64_t prefilter;
  const int64_t* ids;
  int metric;
  const float* center;          // (d) or nullptr
  bool normalize;
  const float* ip_center;       // (d) or nullptr
};
void terms_search(const TermsSearchArgs& a, const float* q, int64_t nq, int64_t k, float* D,
                  int64_t* I, int nthreads);

// A whole IVF search (search.cpp): probe the nprobe nearest of nlist centroids (d), rotate
// the queries (rot), ivf_fast_scan the probed lists (blocked codes `scan` of 32 nb padded rows,
// list_blocks), map padded rows to positions (pos, -1 = padding) and with a refinement re-rank
// the best kk of them (exact vectors ref by rescore_topk, or ref_codes by lut_rescore); D, I
// (nq, k) as faiss returns them (L2 distances, ids[position], padding).
struct IvfSearchArgs {
  int64_t d, nlist, nprobe;
  const float* centroids;  // (nlist, d)
  const float* csq;        // (nlist) squared norms
  RotationArgs rot;
  CodeTable scan;
  const int64_t* list_blocks;  // (nlist + 1)
  const int64_t* pos;          // (scan.n)
  const int64_t* ids;          // (n)
  int64_t n;                   // rows (positions)
  const float* ref;            // (n, d) or nullptr: no exact refinement
  CodedRefine ref_codes;       // or a refinement by codes (codes.codes nullptr: none)
  int metric;                  // RescoreMetric of the index
  int64_t kk;                  // candidates per query (k * k_factor with ref, else k)
};
void ivf_search(const IvfSearchArgs& a, const float* q, int64_t nq, int64_t k, float* D,
                int64_t* I, int nthreads);
// What ivf_search ranks, for merging the searches of several indexes over parts of one
// collection (the index's search_candidates): probes (nq, nprobe) with their offsets, given
// (probed once by a coordinator), or nullptr (probed here); scan, final, I (nq, kk): the scan's
// kk best rows re-ranked by the refinement (best first by it: final) with their scan
// similarities (without one: final = scan), ids; -inf and -1 where there is no row.
void ivf_candidates(const IvfSearchArgs& a, const float* q, int64_t nq, const int64_t* probes,
                    const float* offsets, float* scan, float* final_, int64_t* I,
                    int nthreads);

// A whole graph index search (search.cpp): unit rows for cosine, rotate the queries (rot),
// graph_search with a pool of ef - with exact vectors ref_x (n, d) the best kk expanded rows
// by their exact similarity, else the best kk estimates (L2: minus ||q||^2) -; D, I (nq, k)
// as faiss returns them (padded past kk).
struct GraphSearchArgs {
  GraphArgs graph;
  RotationArgs rot;
  const int64_t* ids;   // (n)
  int metric;           // RescoreMetric of the index's scores
  bool normalize;
  const float* ref_x;   // (n, d) or nullptr
};
void graph_index_search(const GraphSearchArgs& a, const float* q, int64_t nq, int64_t k,
                        int64_t kk, int64_t ef, float* D, int64_t* I, int nthreads);

}  // namespace tqvec
