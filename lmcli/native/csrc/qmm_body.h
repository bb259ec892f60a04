// The float32 (FMA) tile loops, shared by the AVX2 and AVX-512 translation units. Before including:
//   V            a vector of 16 float32 (one per row of a block)
//   vzero(), vbcast(float), vload(const float*), vstore(float*, V), vfma(a, b, c) = a * b + c
//   decode4(const uint8_t* chunk, V c[4])   codes of columns k0..k0+3 for the block's 16 rows
//   decode8(const uint8_t* chunk, V c[2])   codes of columns k0, k0+1
//   RB_MANY, MR_MANY                         tile sizes for several rows; RB_ONE for one row
#include <cstring>

namespace {

template <int RB, int MR, int BITS, bool OFF>
inline void tile(const QmmArgs& a, int64_t b0, int64_t m0) {
  const int64_t K = a.K, G = K / a.group;
  const int per_chunk = BITS == 4 ? 4 : 2;        // columns in a 32-byte chunk
  const int64_t chunks = a.group / per_chunk;     // chunks in a group
  const int64_t block_bytes = K / per_chunk * 32; // one block of 16 rows
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
      const int64_t k0 = g * a.group + c * per_chunk;
      _Pragma("GCC unroll 16")
      for (int r = 0; r < RB; r++) {
        const uint8_t* p = a.codes + (b0 + r) * block_bytes + (g * chunks + c) * 32;
        if (BITS == 4) {
          V w[4];
          decode4(p, w);
          _Pragma("GCC unroll 16")
          for (int m = 0; m < MR; m++) {
            const float* xr = a.xf + (m0 + m) * K + k0;
            acc[r][m] = vfma(vbcast(xr[1]), w[1], acc[r][m]);
            acc[r][m] = vfma(vbcast(xr[0]), w[0], acc[r][m]);
            acc[r][m] = vfma(vbcast(xr[3]), w[3], acc[r][m]);
            acc[r][m] = vfma(vbcast(xr[2]), w[2], acc[r][m]);
          }
        } else {
          V w[2];
          decode8(p, w);
          _Pragma("GCC unroll 16")
          for (int m = 0; m < MR; m++) {
            const float* xr = a.xf + (m0 + m) * K + k0;
            acc[r][m] = vfma(vbcast(xr[1]), w[1], acc[r][m]);
            acc[r][m] = vfma(vbcast(xr[0]), w[0], acc[r][m]);
          }
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

template <int BITS, bool OFF>
void range_fp32(const QmmArgs& a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  if (m1 - m0 == 1) {
    int64_t b = b0;
    for (; b + RB_ONE <= b1; b += RB_ONE) tile<RB_ONE, 1, BITS, OFF>(a, b, m0);
    for (; b < b1; b++) tile<1, 1, BITS, OFF>(a, b, m0);
    return;
  }
  int64_t b = b0;
  for (; b + RB_MANY <= b1; b += RB_MANY) {
    int64_t m = m0;
    for (; m + MR_MANY <= m1; m += MR_MANY) tile<RB_MANY, MR_MANY, BITS, OFF>(a, b, m);
    for (; m < m1; m++) tile<RB_MANY, 1, BITS, OFF>(a, b, m);
  }
  for (; b < b1; b++) {
    int64_t m = m0;
    for (; m + MR_MANY <= m1; m += MR_MANY) tile<1, MR_MANY, BITS, OFF>(a, b, m);
    for (; m < m1; m++) tile<1, 1, BITS, OFF>(a, b, m);
  }
}

inline void range_fp32_any(const QmmArgs* a, int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
  const bool off = a->offsets != nullptr;
  if (a->bits == 4) {
    if (off) range_fp32<4, true>(*a, b0, b1, m0, m1); else range_fp32<4, false>(*a, b0, b1, m0, m1);
  } else {
    if (off) range_fp32<8, true>(*a, b0, b1, m0, m1); else range_fp32<8, false>(*a, b0, b1, m0, m1);
  }
}

}  // namespace
