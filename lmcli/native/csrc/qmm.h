// Group-quantized matrix products: y (M, N) float32 = x (M, K) bfloat16 times W^T, W (N, K) stored as
// integer codes with a float32 scale (and offset) per `group` values of a row: w = code * scale + offset.
//
// Layout (written by lmcli/models/native_kernel.py): rows in blocks of 16 outputs; per block, K in
// chunks of 32 bytes:
//   int4: a chunk covers 4 columns k0..k0+3; byte 2j+t holds code[j][k0+t] (low nibble) and
//         code[j][k0+2+t] (high nibble), j = row in the block, t = 0, 1.
//   int8: a chunk covers 2 columns k0, k0+1; byte 2j+t holds code[j][k0+t] (int8).
// Scales and offsets: float32 (blocks, K / group, 16).
//
// Every output element is summed in one fixed order, whatever M, the thread count or the ISA:
// per group, acc = 0; for each column pair (k, k+1) in order: acc = fma(x[k+1], c[k+1], acc), then
// acc = fma(x[k], c[k], acc) (the order of AVX512-BF16's vdpbf16ps; codes are small integers, so every
// product is exact in float32); then y = fma(scale, acc, y), and with offsets y = fma(offset, xsum, y),
// xsum = the group's x summed in order in float32. So row i of an M-row call equals the 1-row call.
#pragma once
#include <cstdint>

struct QmmArgs {
  const uint16_t* x;    // (M, K) bfloat16 bits
  const float* xf;      // (M, K) x as float32 (the fp32 paths)
  const float* xsum;    // (M, K / group) per-group sums of x, or null without offsets
  int64_t M, K, N;
  const uint8_t* codes;
  const float* scales;
  const float* offsets; // or null
  int64_t group;
  int bits;             // 4 or 8
  float* y;             // (M, ldy) float32; columns 0..N-1 written
  int64_t ldy;
};

// One ISA's work on row blocks [b0, b1) and x rows [m0, m1).
typedef void (*QmmRange)(const QmmArgs*, int64_t b0, int64_t b1, int64_t m0, int64_t m1);

extern "C" {
void lmcli_qmm_range_avx2(const QmmArgs*, int64_t, int64_t, int64_t, int64_t);
void lmcli_qmm_range_avx512(const QmmArgs*, int64_t, int64_t, int64_t, int64_t);
void lmcli_qmm_range_avx512bf16(const QmmArgs*, int64_t, int64_t, int64_t, int64_t);
}
