// lmcli-flags:
// The entry points of the group-quantized products (qmm.h): checks, the float32 copy of x and its
// per-group sums, and the split of the row blocks over OpenMP threads (the threads torch uses once
// torch is loaded: both resolve libgomp.so.1). Compiled without ISA flags; each path lives in its
// own translation unit, called only where __builtin_cpu_supports says it runs.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "qmm.h"

namespace {
enum Isa { AUTO = 0, AVX2 = 1, AVX512 = 2, AVX512BF16 = 3 };

bool supported(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case AVX512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case AVX512BF16: return supported(AVX512) && __builtin_cpu_supports("avx512bf16");
    default: return false;
  }
}

QmmRange range_of(int isa) {
  switch (isa) {
    case AVX2: return lmcli_qmm_range_avx2;
    case AVX512: return lmcli_qmm_range_avx512;
    case AVX512BF16: return lmcli_qmm_range_avx512bf16;
    default: return nullptr;
  }
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr int64_t ROWS_PER_PASS = 64;  // x rows per pass over a thread's weights (kept in cache)
}  // namespace

extern "C" {

// The OpenMP threads a call would use: torch's setting once torch is loaded (one libgomp).
int lmcli_native_threads(void) { return omp_get_max_threads(); }

int lmcli_qmm_supported(int isa) { return supported(isa) ? 1 : 0; }

int lmcli_qmm_best(void) {
  for (int isa : {AVX512BF16, AVX512, AVX2})
    if (supported(isa)) return isa;
  return 0;
}

// y (M, ldy) float32 = x (M, K) bfloat16 times the stored weight (N, K)^T. Returns 0, or -1 for an
// ISA this CPU lacks, -2 for shapes the layout does not hold.
int lmcli_qmm(int isa, const uint16_t* x, int64_t M, int64_t K, const uint8_t* codes, const float* scales,
              const float* offsets, int64_t N, int64_t group, int bits, float* y, int64_t ldy) {
  if (isa == AUTO) isa = lmcli_qmm_best();
  if (!supported(isa)) return -1;
  if ((bits != 4 && bits != 8) || group <= 0 || group % (bits == 4 ? 4 : 2) != 0 || K % group != 0 || M < 0 ||
      N <= 0 || ldy < N)
    return -2;
  if (M == 0) return 0;
  const int64_t G = K / group;
  const bool fp32 = !(isa == AVX512BF16 && bits == 4);
  std::vector<float> xf(fp32 ? M * K : 0), xsum(offsets ? M * G : 0);
  const int64_t blocks = (N + 15) / 16;
  int threads = omp_get_max_threads();
  if (threads > blocks) threads = static_cast<int>(blocks);
  if (M * N * K < (int64_t(1) << 18)) threads = 1;  // too small to pay for waking threads (results alike)
  if (threads < 1) threads = 1;
  QmmArgs a{x, xf.data(), offsets ? xsum.data() : nullptr, M, K, N, codes, scales, offsets, group, bits, y, ldy};
  const QmmRange run = range_of(isa);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    // The copies of x, a row at a time (the same order for a row whatever M).
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
      const uint16_t* xr = x + m * K;
      if (fp32)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf16_to_float(xr[k]);
      if (offsets)
        for (int64_t g = 0; g < G; g++) {
          float s = 0.0f;
          for (int64_t k = g * group; k < (g + 1) * group; k++) s += bf16_to_float(xr[k]);
          xsum[m * G + g] = s;
        }
    }  // implicit barrier
    const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_PER_PASS) {
      const int64_t m1 = m0 + ROWS_PER_PASS < M ? m0 + ROWS_PER_PASS : M;
      if (b0 < b1) run(&a, b0, b1, m0, m1);
    }
  }
  return 0;
}

}  // extern "C"
