// The body of LoRA's update (lora.cpp), compiled once per instruction set: lora.cpp (no ISA flags) and
// lora_avx512.cpp. Every output is summed in the same order in both (vectorised only across outputs,
// no fused multiply-add: -ffp-contract=off), so both give the same bits.
#pragma once
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 (NaN kept a quiet NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

constexpr int MAX_RANK = 1024;

template <bool TBF16>
inline float table(const void* t, int64_t i) {
  return TBF16 ? bf16_to_float(static_cast<const uint16_t*>(t)[i]) : static_cast<const float*>(t)[i];
}

// The tables of row i: the call's one adapter (index null), or entry index[i] of (entries, K, R) and
// (entries, R, N) tables; false where the row gets no update (no entry, or one not adapting this module).
template <bool TBF16>
inline bool tables_of(int64_t i, const void* at, const void* bt, int64_t k, int64_t r, int64_t n,
                      const int64_t* index, const uint8_t* adapted, int64_t entries, const void** a,
                      const void** b) {
  if (index == nullptr) {
    *a = at;
    *b = bt;
    return true;
  }
  const int64_t e = index[i];
  if (e < 0 || e >= entries || !adapted[e]) return false;
  const int64_t size = TBF16 ? 2 : 4;
  *a = static_cast<const char*>(at) + e * k * r * size;
  *b = static_cast<const char*>(bt) + e * r * n * size;
  return true;
}

// Row i with its tables (tables_of). (Splitting a lone row's output columns across threads would keep
// its bits, but measured no faster in decode: the tables come from memory either way.)
template <bool XBF16, bool OUTBF16, bool TBF16>
void row(const void* x, int64_t i, int64_t k, const void* at, int64_t r, const void* bt, int64_t n,
         void* out, int64_t out_stride, int accumulate, const int64_t* index, const uint8_t* adapted,
         int64_t entries) {
  const void *a, *b;
  if (!tables_of<TBF16>(i, at, bt, k, r, n, index, adapted, entries, &a, &b)) return;
  float down[MAX_RANK];
  for (int64_t j = 0; j < r; ++j) down[j] = 0.0f;
  for (int64_t c = 0; c < k; ++c) {  // down[j] = sum over c, in order, of x[c] * A[j, c]
    const float v = XBF16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i * k + c])
                          : static_cast<const float*>(x)[i * k + c];
    for (int64_t j = 0; j < r; ++j) down[j] += v * table<TBF16>(a, c * r + j);  // Aᵀ (K, R): row c
  }
  thread_local std::vector<float> up;  // one buffer a thread: no allocation a call
  if (up.size() < static_cast<size_t>(n)) up.resize(static_cast<size_t>(n));
  float* u = up.data();
  for (int64_t o = 0; o < n; ++o) u[o] = 0.0f;
  for (int64_t j = 0; j < r; ++j) {  // up[o] = sum over j, in order, of down[j] * B[o, j]
    const float d = down[j];
    for (int64_t o = 0; o < n; ++o) u[o] += d * table<TBF16>(b, j * n + o);  // Bᵀ (R, N): row j
  }
  if (OUTBF16) {
    uint16_t* y = static_cast<uint16_t*>(out) + i * out_stride;
    for (int64_t o = 0; o < n; ++o) y[o] = float_to_bf16(accumulate ? bf16_to_float(y[o]) + u[o] : u[o]);
  } else {
    float* y = static_cast<float*>(out) + i * out_stride;
    for (int64_t o = 0; o < n; ++o) y[o] = accumulate ? y[o] + u[o] : u[o];
  }
}

template <bool XBF16, bool OUTBF16, bool TBF16>
void rows(const void* x, int64_t m, int64_t k, const void* at, int64_t r, const void* bt, int64_t n,
          void* out, int64_t out_stride, int accumulate, const int64_t* index, const uint8_t* adapted,
          int64_t entries) {
  if (m == 1) {  // decode: no OpenMP region to enter
    row<XBF16, OUTBF16, TBF16>(x, 0, k, at, r, bt, n, out, out_stride, accumulate, index, adapted, entries);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i)
    row<XBF16, OUTBF16, TBF16>(x, i, k, at, r, bt, n, out, out_stride, accumulate, index, adapted, entries);
}

// rows<> for the dtypes of x, out and the tables.
inline void rows_of_kind(int kind, const void* x, int64_t m, int64_t k, const void* at, int64_t r, const void* bt,
                         int64_t n, void* out, int64_t out_stride, int accumulate, const int64_t* index,
                         const uint8_t* adapted, int64_t entries) {
  using Rows = void (*)(const void*, int64_t, int64_t, const void*, int64_t, const void*, int64_t, void*, int64_t,
                        int, const int64_t*, const uint8_t*, int64_t);
  static constexpr Rows by_kind[8] = {rows<false, false, false>, rows<false, false, true>, rows<false, true, false>,
                                      rows<false, true, true>,   rows<true, false, false>, rows<true, false, true>,
                                      rows<true, true, false>,   rows<true, true, true>};
  by_kind[kind](x, m, k, at, r, bt, n, out, out_stride, accumulate, index, adapted, entries);
}

}  // namespace

#define LMCLI_LORA_BODY(NAME)                                                                              \
  int NAME(const void* x, int x_bf16, int64_t m, int64_t k, const void* at, int64_t r, const void* bt,  \
           int64_t n, int tables_bf16, void* out, int out_bf16, int64_t out_stride, int accumulate,     \
           const int64_t* index, const uint8_t* adapted, int64_t entries) {                              \
    if (r > MAX_RANK || r < 0) return 1;                                                                \
    const int kind = (x_bf16 ? 4 : 0) | (out_bf16 ? 2 : 0) | (tables_bf16 ? 1 : 0);                     \
    rows_of_kind(kind, x, m, k, at, r, bt, n, out, out_stride, accumulate, index, adapted, entries);     \
    return 0;                                                                                           \
  }
