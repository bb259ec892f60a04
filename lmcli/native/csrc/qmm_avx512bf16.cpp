// lmcli-flags: -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma
// AVX512-BF16 path: int4 codes become bfloat16 by a 16-entry table (vpermw) and are summed with
// vdpbf16ps, which adds x[k+1] c[k+1] then x[k] c[k] into each float32 lane, each product exact and
// each add rounded: the order of the float32 paths. int8 weights take the float32 path (the
// conversion to bfloat16 costs more than it saves at few rows).
#include <immintrin.h>

#include <cstring>

#include "qmm.h"

#include "qmm_avx512_vec.h"

namespace {

// bfloat16 bits of 0.0 .. 15.0, twice (vpermw reads the low 5 bits of each index).
inline __m512i code_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; i++) {
    const float f = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(t);
}

inline __m512 dp(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(w), reinterpret_cast<__m512bh&>(x));
}

inline __m512i xpair(const uint16_t* p) {  // x[k], x[k+1] in every dword
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int RB, int MR, bool OFF>
inline void tile_bf16(const QmmArgs& a, int64_t b0, int64_t m0, __m512i table) {
  const int64_t K = a.K, G = K / a.group;
  const int64_t chunks = a.group / 4;
  const int64_t block_bytes = K / 4 * 32;
  const __m512i nib = _mm512_set1_epi16(15);
  V y[RB][MR];
  _Pragma("GCC unroll 16")
  for (int r = 0; r < RB; r++)
    _Pragma("GCC unroll 16")
    for (int m = 0; m < MR; m++) y[r][m] = vzero();
  for (int64_t g = 0; g < G; g++) {
    V acc[RB][MR];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < RB; r++)
      _Pragma("GCC unroll 16")
      for (int m = 0; m < MR; m++) acc[r][m] = vzero();
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t k0 = g * a.group + c * 4;
      __m512i xa[MR], xb[MR];
      _Pragma("GCC unroll 16")
      for (int m = 0; m < MR; m++) {
        xa[m] = xpair(a.x + (m0 + m) * K + k0);
        xb[m] = xpair(a.x + (m0 + m) * K + k0 + 2);
      }
      _Pragma("GCC unroll 16")
      for (int r = 0; r < RB; r++) {
        const uint8_t* p = a.codes + (b0 + r) * block_bytes + (g * chunks + c) * 32;
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512i wa = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, nib), table);  // columns k0, k0+1
        const __m512i wb = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);   // k0+2, k0+3
        _Pragma("GCC unroll 16")
        for (int m = 0; m < MR; m++) {
          acc[r][m] = dp(acc[r][m], wa, xa[m]);
          acc[r][m] = dp(acc[r][m], wb, xb[m]);
        }
      }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < RB; r++) {
      const V s = vload(a.scales + ((b0 + r) * G + g) * 16);
      _Pragma("GCC unroll 16")
      for (int m = 0; m < MR; m++) {
        y[r][m] = vfma(s, acc[r][m], y[r][m]);
        if (OFF) y[r][m] = vfma(vload(a.offsets + ((b0 + r) * G + g) * 16), vbcast(a.xsum[(m0 + m) * G + g]), y[r][m]);
      }
    }
  }
  _Pragma("GCC unroll 16")
  for (int r = 0; r < RB; r++) {
    const int64_t n0 = (b0 + r) * 16;
    _Pragma("GCC unroll 16")
    for (int m = 0; m < MR; m++) {
      float* out = a.y + (m0 + m) * a.ldy + n0;
      if (n0 + 16 <= a.N) {
        vstore(out, y[r][m]);
      } else {
        alignas(64) float tmp[16];
        vstore(tmp, y[r][m]);
        std::memcpy(out, tmp, sizeof(float) * (a.N - n0));
      }
    }
  }
}

template <bool OFF>
void range_bf16(const QmmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  const __m512i table = code_table();
  constexpr int RB1 = 8, RBN = 4, MRN = 4;
  if (m1 - m0 == 1) {
    int64_t b = b0;
    for (; b + RB1 <= b1; b += RB1) tile_bf16<RB1, 1, OFF>(a, b, m0, table);
    for (; b < b1; b++) tile_bf16<1, 1, OFF>(a, b, m0, table);
    return;
  }
  int64_t b = b0;
  for (; b + RBN <= b1; b += RBN) {
    int64_t m = m0;
    for (; m + MRN <= m1; m += MRN) tile_bf16<RBN, MRN, OFF>(a, b, m, table);
    for (; m < m1; m++) tile_bf16<RBN, 1, OFF>(a, b, m, table);
  }
  for (; b < b1; b++) {
    int64_t m = m0;
    for (; m + MRN <= m1; m += MRN) tile_bf16<1, MRN, OFF>(a, b, m, table);
    for (; m < m1; m++) tile_bf16<1, 1, OFF>(a, b, m, table);
  }
}
}  // namespace

#include "qmm_body.h"

extern "C" void lmcli_qmm_range_avx512bf16(const QmmArgs* a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  if (a->bits != 4) {
    range_fp32_any(a, b0, b1, m0, m1);
  } else if (a->offsets != nullptr) {
    range_bf16<true>(*a, b0, b1, m0, m1);
  } else {
    range_bf16<false>(*a, b0, b1, m0, m1);
  }
}
