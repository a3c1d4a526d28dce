// Binding of decode attention over TurboQuant-mse key/value codes.
#include "check.h"

namespace tqvec::bind {

void bind_attention(nb::module_& m) {
  m.def("decode_attention", [](CArr<const float> qr, CArr<const float> qbias,
                               CArr<const uint8_t> kpacked, CArr<const float> knorm,
                               CArr<const float> kcent, int kb, CArr<const uint8_t> vpacked,
                               CArr<const float> vnorm, CArr<const float> vcent, int vb,
                               CArr<const int32_t> lo, CArr<const int32_t> hi, float scale,
                               CArr<float> m, CArr<float> l, CArr<float> acc, int nthreads) {
    const char* op = "decode_attention";
    check_bits(kb, 8, op);
    check_bits(vb, 8, op);
    check_shape(qr, {kAny, kAny, kAny}, op, "qr");
    const int64_t bh = dim(qr, 0), g = dim(qr, 1), d = dim(qr, 2);
    check_shape(kpacked, {bh, kAny, packed_row_bytes(d, kb)}, op, "kpacked");
    const int64_t t = dim(kpacked, 1);
    check_shape(qbias, {bh, g}, op, "qbias");
    check_shape(vpacked, {bh, t, packed_row_bytes(d, vb)}, op, "vpacked");
    check_shape(knorm, {bh, t}, op, "knorm");
    check_shape(vnorm, {bh, t}, op, "vnorm");
    check_shape(kcent, {int64_t{1} << kb}, op, "kcent");
    check_shape(vcent, {int64_t{1} << vb}, op, "vcent");
    check_shape(lo, {bh}, op, "lo");
    check_shape(hi, {bh}, op, "hi");
    check_shape(m, {bh, g}, op, "m");
    check_shape(l, {bh, g}, op, "l");
    check_shape(acc, {bh, g, d}, op, "acc");
    nb::gil_scoped_release rel;
    decode_attention(qr.data(), qbias.data(), bh, g, d, kpacked.data(), knorm.data(),
                     kcent.data(), kb, vpacked.data(), vnorm.data(), vcent.data(), vb, t,
                     lo.data(), hi.data(), scale, m.data(), l.data(), acc.data(), nthreads);
  });
}

}  // namespace tqvec::bind
