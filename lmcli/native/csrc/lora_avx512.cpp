// lmcli-flags: -mavx512f -mavx512bw -mavx512vl -mavx512dq
// LoRA's update (lora_body.h) built for AVX-512; lora.cpp calls it where the CPU has it.
#include "lora_body.h"

namespace {
LMCLI_LORA_BODY(lora_wide)
}  // namespace

extern "C" int lmcli_lora_avx512(const void* x, int x_bf16, int64_t m, int64_t k, const void* at, int64_t r,
                                 const void* bt, int64_t n, int tables_bf16, void* out, int out_bf16,
                                 int64_t out_stride, int accumulate, const int64_t* index, const uint8_t* adapted,
                                 int64_t entries) {
  return lora_wide(x, x_bf16, m, k, at, r, bt, n, tables_bf16, out, out_bf16, out_stride, accumulate, index,
                   adapted, entries);
}
