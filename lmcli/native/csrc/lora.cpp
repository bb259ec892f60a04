// lmcli-flags:
// LoRA's update beside a projection (kernels/lora.py): out[i] (+)= (x[i]·Aᵀ)·Bᵀ for each row i, one
// call per adapted module instead of about five tensor operations. Each row on its own, each sum in
// one fixed order (over K in order, then over the rank in order), vectorised only across independent
// outputs (the rank's entries, then the output columns): the same bits whatever the row count, the
// threads or the instruction set the compiler picked. Built without -ffast-math and with
// -ffp-contract=off (native/__init__.py), so no product is fused into its sum.
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

template <bool XBF16, bool OUTBF16>
void row(const void* x, int64_t i, int64_t k, const float* at, int64_t r, const float* bt, int64_t n,
         void* out, int64_t out_stride, int accumulate) {
  float down[MAX_RANK];
  for (int64_t j = 0; j < r; ++j) down[j] = 0.0f;
  for (int64_t c = 0; c < k; ++c) {  // down[j] = sum over c, in order, of x[c] * A[j, c]
    const float v = XBF16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i * k + c])
                          : static_cast<const float*>(x)[i * k + c];
    const float* a_row = at + c * r;  // Aᵀ (K, R): row c
    for (int64_t j = 0; j < r; ++j) down[j] += v * a_row[j];
  }
  std::vector<float> up(static_cast<size_t>(n), 0.0f);
  float* u = up.data();
  for (int64_t j = 0; j < r; ++j) {  // up[o] = sum over j, in order, of down[j] * B[o, j]
    const float d = down[j];
    const float* b_row = bt + j * n;  // Bᵀ (R, N): row j
    for (int64_t o = 0; o < n; ++o) u[o] += d * b_row[o];
  }
  if (OUTBF16) {
    uint16_t* y = static_cast<uint16_t*>(out) + i * out_stride;
    for (int64_t o = 0; o < n; ++o) y[o] = float_to_bf16(accumulate ? bf16_to_float(y[o]) + u[o] : u[o]);
  } else {
    float* y = static_cast<float*>(out) + i * out_stride;
    for (int64_t o = 0; o < n; ++o) y[o] = accumulate ? y[o] + u[o] : u[o];
  }
}

template <bool XBF16, bool OUTBF16>
void rows(const void* x, int64_t m, int64_t k, const float* at, int64_t r, const float* bt, int64_t n,
          void* out, int64_t out_stride, int accumulate) {
  if (m == 1) {  // decode: no OpenMP region to enter
    row<XBF16, OUTBF16>(x, 0, k, at, r, bt, n, out, out_stride, accumulate);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) row<XBF16, OUTBF16>(x, i, k, at, r, bt, n, out, out_stride, accumulate);
}

}  // namespace

extern "C" {

// x (m, k) float32 or bfloat16 (x_bf16), contiguous; at = Aᵀ (k, r) and bt = (scale·B)ᵀ (r, n) float32,
// contiguous; out (m, n) with row stride out_stride, float32 or bfloat16 (out_bf16): out = update, or
// out = out + update (accumulate, the sum in float32, then rounded once). Returns 0, or 1 for a rank
// past MAX_RANK.
int lmcli_lora(const void* x, int x_bf16, int64_t m, int64_t k, const float* at, int64_t r, const float* bt,
               int64_t n, void* out, int out_bf16, int64_t out_stride, int accumulate) {
  if (r > MAX_RANK || r < 0) return 1;
  if (x_bf16) {
    if (out_bf16) rows<true, true>(x, m, k, at, r, bt, n, out, out_stride, accumulate);
    else rows<true, false>(x, m, k, at, r, bt, n, out, out_stride, accumulate);
  } else {
    if (out_bf16) rows<false, true>(x, m, k, at, r, bt, n, out, out_stride, accumulate);
    else rows<false, false>(x, m, k, at, r, bt, n, out, out_stride, accumulate);
  }
  return 0;
}

}  // extern "C"
