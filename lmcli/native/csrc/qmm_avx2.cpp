// lmcli-flags: -mavx2 -mfma
// Float32 FMA path for AVX2: two ymm = the 16 rows of a block.
#include <immintrin.h>

#include "qmm.h"

namespace {
struct V {
  __m256 lo, hi;
};
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vbcast(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline void decode4_half(__m256i d, __m256 w[4]) {
  const __m256i m = _mm256_set1_epi32(15);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(d, m));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, 8), m));
  w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, 4), m));
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 12));
}
inline void decode4(const uint8_t* p, V w[4]) {
  __m256 lo[4], hi[4];
  decode4_half(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), lo);
  decode4_half(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))), hi);
  for (int i = 0; i < 4; i++) w[i] = {lo[i], hi[i]};
}
inline void decode8(const uint8_t* p, V w[2]) {
  const __m256i lo = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  w[0] = {_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(lo, 24), 24)),
          _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(hi, 24), 24))};
  w[1] = {_mm256_cvtepi32_ps(_mm256_srai_epi32(lo, 8)), _mm256_cvtepi32_ps(_mm256_srai_epi32(hi, 8))};
}
constexpr int RB_ONE = 4, RB_MANY = 2, MR_MANY = 2;
}  // namespace

#include "qmm_body.h"

extern "C" void lmcli_qmm_range_avx2(const QmmArgs* a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  range_fp32_any(a, b0, b1, m0, m1);
}
