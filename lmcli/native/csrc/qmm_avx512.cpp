// lmcli-flags: -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma
// Float32 FMA path for AVX-512F/BW: one zmm = the 16 rows of a block.
#include <immintrin.h>

#include "qmm.h"

#include "qmm_avx512_vec.h"

#include "qmm_body.h"

extern "C" void lmcli_qmm_range_avx512(const QmmArgs* a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  range_fp32_any(a, b0, b1, m0, m1);
}
