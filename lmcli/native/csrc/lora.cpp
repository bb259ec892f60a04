// lmcli-flags:
// LoRA's update beside a projection (kernels/lora.py): out[i] (+)= (x[i]·Aᵀ)·Bᵀ for each row i, one
// call per adapted module instead of about five tensor operations. Each row on its own, each sum in
// one fixed order (over K in order, then over the rank in order), vectorised only across independent
// outputs (the rank's entries, then the output columns): the same bits whatever the row count, the
// threads or the instruction set the compiler picked. Built without -ffast-math and with
// -ffp-contract=off (native/__init__.py), so no product is fused into its sum.
#include "lora_body.h"

extern "C" {
int lmcli_lora_avx512(const void* x, int x_bf16, int64_t m, int64_t k, const void* at, int64_t r, const void* bt,
                      int64_t n, int tables_bf16, void* out, int out_bf16, int64_t out_stride, int accumulate,
                      const int64_t* index, const uint8_t* adapted, int64_t entries);
}

namespace {
LMCLI_LORA_BODY(lora_portable)

bool avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
}  // namespace

extern "C" {

// x (m, k) float32 or bfloat16 (x_bf16), contiguous; at = Aᵀ (k, r) and bt = (scale·B)ᵀ (r, n), contiguous,
// float32 or bfloat16 (tables_bf16; either way every product and sum is in float32); out (m, n) with row
// stride out_stride, float32 or bfloat16 (out_bf16): out = update, or out = out + update (accumulate, the
// sum in float32, then rounded once). With `index` (m int64s; a mixed batch), at and bt are instead the
// bases of every adapter's tables, (entries, K, R) and (entries, R, N): row i takes entry index[i], or
// no update where index[i] is out of range or adapted[index[i]] is 0 (an adapter not on this module: its
// tables are zeros, skipped).
// Returns 0, or 1 for a rank past MAX_RANK. The AVX-512 build where the CPU has it (the same bits:
// lora_body.h), unless LMCLI_NATIVE_ISA asks for another path.
int lmcli_lora(const void* x, int x_bf16, int64_t m, int64_t k, const void* at, int64_t r, const void* bt,
               int64_t n, int tables_bf16, void* out, int out_bf16, int64_t out_stride, int accumulate,
               const int64_t* index, const uint8_t* adapted, int64_t entries, int portable) {
  static const bool wide = avx512();
  if (wide && !portable)
    return lmcli_lora_avx512(x, x_bf16, m, k, at, r, bt, n, tables_bf16, out, out_bf16, out_stride, accumulate,
                             index, adapted, entries);
  return lora_portable(x, x_bf16, m, k, at, r, bt, n, tables_bf16, out, out_bf16, out_stride, accumulate, index,
                       adapted, entries);
}

}  // extern "C"
