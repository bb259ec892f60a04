// The AVX-512 vector that qmm_body.h's float32 loops take: one zmm = the 16 rows of a block. Shared by
// qmm_avx512.cpp and qmm_avx512bf16.cpp (include after <immintrin.h> and "qmm.h").
#pragma once

namespace {
typedef __m512 V;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vbcast(float v) { return _mm512_set1_ps(v); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline void decode4(const uint8_t* p, V w[4]) {
  // dword j = byte 2j | byte 2j+1 << 8: codes of row j, columns k0 (low nibbles), k0+2 (high nibbles)
  const __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i m = _mm512_set1_epi32(15);
  w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(d, m));
  w[1] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, 8), m));
  w[2] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, 4), m));
  w[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 12));
}
inline void decode8(const uint8_t* p, V w[2]) {
  const __m512i d = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  w[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 24), 24));
  w[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(d, 8));
}
constexpr int RB_ONE = 8, RB_MANY = 4, MR_MANY = 4;
}  // namespace
