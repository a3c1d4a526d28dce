// Several codes per row (fast_scan_terms): score_i = add_i + sum_t mult_t[i] <qr_t,
// c_t[idx_t,i]>, each term with its own codes, width, table and multiplier (layouts:
// ../fastscan.h).
#pragma once
#include <cstdint>
#include <vector>

#include "../kernels.h"
#include "tables.h"

namespace tqvec::fastscan {

struct TermScan {
  Lut L;
  const uint8_t* blocked;
  int64_t rb;
  const float* mult;
};

constexpr int kMaxTerms = 8;  // = ops.MAX_SCAN_TERMS (mixed-width codes: one term per run)

// Query qi's exact scores of the candidate rows with every term, from the terms' packed
// (row-major) codes -> its top k (the second pass of a two-stage scan). ub: the rows' upper
// bounds, largest first, or null; given, the pass stops where no later row can enter.
void rescore_terms(const ScanTerm* terms, int nterms, int64_t qi, const std::vector<int64_t>& rows,
                   const float* add, int64_t k, float* vals, int64_t* idx,
                   const float* ub = nullptr);

}  // namespace tqvec::fastscan
