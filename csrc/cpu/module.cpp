// tqvec._C: the compiled CPU kernels (layouts: kernels.h), bound by concern in bind/.
#include "bind/check.h"

NB_MODULE(_C, m) {
  m.doc() = "tqvec compiled CPU kernels (see csrc/cpu/kernels.h for layouts)";
  tqvec::bind::bind_codes(m);
  tqvec::bind::bind_scans(m);
  tqvec::bind::bind_attention(m);
  tqvec::bind::bind_searchers(m);
  tqvec::bind::bind_graph(m);
}
