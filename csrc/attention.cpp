// Batch- and chunk-invariant attention for lmcli (lmcli/models/native_attention.py loads it).
//
// Each query (row b, query t) attends to a run of its row's key list: keys[b, first[b,t] : end[b,t]]
// (indices into the cache's slots, in slot order). Its output is an online softmax over that run in
// blocks of KB keys counted from the query's own first key, so the blocks, and every floating-point
// operation on them, follow from the query's own keys alone: not from the other queries of the call,
// the chunk it was prefilled in, the batch, or the thread count (a query is computed by one thread).
// Per block and query head: scores = q . k as a chain of multiply-adds over d = 0..hd-1 (one chain per
// key), times scale (then softcapped), masked beyond the query's keys; a running max m; p = exp(s - m);
// per-lane sums rescaled by exp(m_old - m_new) and the output rescaled and accumulated p_j * v_j over
// j in order; at the end the lanes summed in order and the output divided by that sum. All in float32.
// Queries of one row that share their first key are computed together (a tile), so a block of keys is
// converted once for all of them; what is computed for each is the same as for it alone.
//
// Memory: a tile's state and one block of keys, per thread; nothing grows with the square of the text.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int KB = 32;        // keys per block
constexpr int TQ = 32;        // most queries in a tile
constexpr int MAX_HD = 512;

// 16 floats as one value (GCC's vector extension: one 512-bit register with AVX-512, two or four
// narrower ones elsewhere; the same operations on each element either way).
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

inline vf16 load16(const float* p) {
    vf16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store16(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float load(const void* base, int64_t i, int dtype) {
    return dtype == 1 ? bf16_to_f32(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

// exp(x) for x <= 0 (Cephes' expf polynomial), written so that the compiler vectorizes it; the same
// operations in every lane, so a lane's value does not depend on its neighbours or on the vector width.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  // and -inf, masked keys, whose p is then set to 0
    const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    int32_t e = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &e, 4);
    return y * scale;
}

// exp_nonpositive on 16 lanes: the same operations on each.
inline vf16 exp16(vf16 x) {
    const vf16 low = vf16{} - 87.0f;
    x = x < low ? low : x;
    const float shifter = 12582912.0f;
    vf16 n = (x * 1.44269504088896341f + shifter) - shifter;
    vf16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf16 p = vf16{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf16 y = p * (r * r) + r + 1.0f;
    vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
    vf16 scale;
    std::memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

inline float max16(vf16 v, float start) {
    float t[16];
    store16(t, v);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) t[i] = t[i] > t[i + w] ? t[i] : t[i + w];
    return t[0] > start ? t[0] : start;
}

struct Args {
    const void* q; const void* k; const void* v; void* out; int dtype;
    int64_t B, T, nh, nkv, hd;
    int64_t qs[3], ks[3], vs[3];  // strides (b, head, t or slot); d has stride 1
    const int64_t* keys; int64_t L;
    const int64_t* first; const int64_t* end;
    float scale, softcap;
};

struct Tile { int64_t b, kvh, count; int64_t t[TQ]; };

// G query heads at once: their score chains interleave (independent), each computed as alone.
template <int G>
void score_block(const float* Q, const float* Kt, int64_t hd, float* S) {
    float acc[G][KB];
    for (int g = 0; g < G; ++g)
        for (int j = 0; j < KB; ++j) acc[g][j] = 0.0f;
    for (int64_t d = 0; d < hd; ++d) {
        const float* krow = Kt + d * KB;
        for (int g = 0; g < G; ++g) {
            const float qd = Q[g * hd + d];
            for (int j = 0; j < KB; ++j) acc[g][j] = qd * krow[j] + acc[g][j];
        }
    }
    for (int g = 0; g < G; ++g)
        for (int j = 0; j < KB; ++j) S[g * KB + j] = acc[g][j];
}

// o = o * alpha, then o = p_j * v_j + o for j = 0..nv-1 in order, for G query heads of one query (same
// nv) at once, HD known: the outputs stay in registers, and the G heads' chains interleave.
template <int HD, int G>
void pv_block(const float* P, const float* V, int64_t nv, const float* alpha, float* O) {
    constexpr int W = HD / 16;
    vf16 acc[G][W];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w) acc[g][w] = load16(O + g * HD + w * 16) * alpha[g];
    for (int64_t j = 0; j < nv; ++j) {
        const float* vj = V + j * HD;
        vf16 vv[W];
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w) {
            vv[w] = load16(vj + w * 16);
#if defined(__x86_64__) && defined(__AVX512F__)
            asm("" : "+v"(vv[w]));  // kept in a register: loaded once for the G heads, not once per head
#endif
        }
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) {
            const float p = P[g * KB + j];
#pragma GCC unroll 16
            for (int w = 0; w < W; ++w) acc[g][w] = p * vv[w] + acc[g][w];
        }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w) store16(O + g * HD + w * 16, acc[g][w]);
}

// The same for any head size, one head at a time (the outputs in memory).
void pv_any(const float* P, const float* V, int64_t nv, float alpha, float* O, int64_t hd) {
    for (int64_t d = 0; d < hd; ++d) O[d] = O[d] * alpha;
    for (int64_t j = 0; j < nv; ++j) {
        const float p = P[j];
        const float* vj = V + j * hd;
        for (int64_t d = 0; d < hd; ++d) O[d] = p * vj[d] + O[d];
    }
}

using PvFn = void (*)(const float*, const float*, int64_t, const float*, float*);
// [head size 64, 128, 256][G - 1]: at most 16 vector registers of outputs at 512 bits
constexpr PvFn PV[3][4] = {{pv_block<64, 1>, pv_block<64, 2>, pv_block<64, 3>, pv_block<64, 4>},
                           {pv_block<128, 1>, pv_block<128, 2>, nullptr, nullptr},
                           {pv_block<256, 1>, nullptr, nullptr, nullptr}};

using ScoreFn = void (*)(const float*, const float*, int64_t, float*);
constexpr int SCORE_GROUP = KB == 32 ? 8 : 6;  // accumulators that fit the 32 vector registers
constexpr ScoreFn SCORE[9] = {nullptr, score_block<1>, score_block<2>, score_block<3>, score_block<4>,
                              score_block<5>, score_block<6>, score_block<7>, score_block<8>};

void run_tile(const Args& a, const Tile& tile, std::vector<float>& work) {
    const int64_t hd = a.hd, rep = a.nh / a.nkv, b = tile.b, kvh = tile.kvh;
    const int64_t heads = tile.count * rep;  // query heads of the tile: (query i, head h) -> i * rep + h
    const int pv_kind = hd == 64 ? 0 : hd == 128 ? 1 : hd == 256 ? 2 : -1;
    const int64_t group = hd == 64 ? 4 : hd == 128 ? 2 : 1;  // heads per pv_block call
    work.resize(static_cast<size_t>(heads * hd * 2 + heads * KB * 2 + heads + 2 * KB * hd + rep));
    float* Q = work.data();          // [heads, hd]
    float* O = Q + heads * hd;       // [heads, hd]
    float* LS = O + heads * hd;      // [heads, KB] per-lane sums
    float* S = LS + heads * KB;      // [heads, KB] scores, then p
    float* M = S + heads * KB;       // [heads] running max
    float* Kt = M + heads;           // [hd, KB] the block's keys, transposed
    float* V = Kt + KB * hd;         // [KB, hd]
    float* A = V + KB * hd;          // [rep] a query's heads' rescaling this block
    const int64_t f = a.first[b * a.T + tile.t[0]];
    int64_t E = f;
    int64_t ends[TQ];
    for (int64_t i = 0; i < tile.count; ++i) {
        ends[i] = a.end[b * a.T + tile.t[i]];
        E = ends[i] > E ? ends[i] : E;
        for (int64_t h = 0; h < rep; ++h) {
            const int64_t base = b * a.qs[0] + (kvh * rep + h) * a.qs[1] + tile.t[i] * a.qs[2];
            for (int64_t d = 0; d < hd; ++d) Q[(i * rep + h) * hd + d] = load(a.q, base + d, a.dtype);
        }
    }
    std::memset(O, 0, sizeof(float) * heads * hd);
    std::memset(LS, 0, sizeof(float) * heads * KB);
    for (int64_t x = 0; x < heads; ++x) M[x] = -INFINITY;
    const int64_t* keys = a.keys + b * a.L;
    for (int64_t j0 = f; j0 < E; j0 += KB) {
        const int64_t nb = E - j0 < KB ? E - j0 : KB;
        for (int64_t j = 0; j < KB; ++j) {
            if (j < nb) {
                const int64_t slot = keys[j0 + j];
                const int64_t kb = b * a.ks[0] + kvh * a.ks[1] + slot * a.ks[2];
                const int64_t vb = b * a.vs[0] + kvh * a.vs[1] + slot * a.vs[2];
                if (a.dtype == 1) {
                    const uint16_t* ks = static_cast<const uint16_t*>(a.k) + kb;
                    const uint16_t* vs = static_cast<const uint16_t*>(a.v) + vb;
                    for (int64_t d = 0; d < hd; ++d) Kt[d * KB + j] = bf16_to_f32(ks[d]);
                    for (int64_t d = 0; d < hd; ++d) V[j * hd + d] = bf16_to_f32(vs[d]);
                } else {
                    const float* ks = static_cast<const float*>(a.k) + kb;
                    const float* vs = static_cast<const float*>(a.v) + vb;
                    for (int64_t d = 0; d < hd; ++d) Kt[d * KB + j] = ks[d];
                    for (int64_t d = 0; d < hd; ++d) V[j * hd + d] = vs[d];
                }
            } else {
                for (int64_t d = 0; d < hd; ++d) Kt[d * KB + j] = 0.0f;
            }
        }
        for (int64_t x = 0; x < heads; x += SCORE_GROUP) {
            const int64_t g = heads - x < SCORE_GROUP ? heads - x : SCORE_GROUP;
            SCORE[g](Q + x * hd, Kt, hd, S + x * KB);
        }
        for (int64_t i = 0; i < tile.count; ++i) {
            if (ends[i] <= j0) continue;  // this query's keys ended before the block
            const int64_t nv = ends[i] - j0 < KB ? ends[i] - j0 : KB;
            for (int64_t h = 0; h < rep; ++h) {
                const int64_t x = i * rep + h;
                float* s = S + x * KB;
                float* ls = LS + x * KB;
                constexpr int NV = KB / 16;
                vf16 sv[NV];
                for (int w = 0; w < NV; ++w) sv[w] = load16(s + 16 * w) * a.scale;
                if (a.softcap > 0.0f) {
                    for (int w = 0; w < NV; ++w) store16(s + 16 * w, sv[w]);
                    for (int j = 0; j < KB; ++j) s[j] = std::tanh(s[j] / a.softcap) * a.softcap;
                    for (int w = 0; w < NV; ++w) sv[w] = load16(s + 16 * w);
                }
                const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
                const vf16 none = vf16{} - INFINITY;
                const int32_t valid = static_cast<int32_t>(nv);
                vf16 top = none;
                for (int w = 0; w < NV; ++w) {
                    sv[w] = lane + 16 * w < valid ? sv[w] : none;  // beyond this query's keys
                    top = top > sv[w] ? top : sv[w];
                }
                const float m = max16(top, M[x]);  // a max: the same in any order
                const float alpha = M[x] == -INFINITY ? 0.0f : exp_nonpositive(M[x] - m);
                M[x] = m;
                A[h] = alpha;
                const vf16 zero = {};
                for (int w = 0; w < NV; ++w) {
                    const vf16 p = lane + 16 * w < valid ? exp16(sv[w] - m) : zero;
                    store16(s + 16 * w, p);
                    store16(ls + 16 * w, load16(ls + 16 * w) * alpha + p);
                }
            }
            const int64_t x0 = i * rep;
            for (int64_t h = 0; h < rep;) {
                const int64_t g = rep - h < group ? rep - h : group;
                if (pv_kind >= 0) PV[pv_kind][g - 1](S + (x0 + h) * KB, V, nv, A + h, O + (x0 + h) * hd);
                else pv_any(S + (x0 + h) * KB, V, nv, A[h], O + (x0 + h) * hd, hd);
                h += pv_kind >= 0 ? g : 1;
            }
        }
    }
    for (int64_t i = 0; i < tile.count; ++i) {
        for (int64_t h = 0; h < rep; ++h) {
            const int64_t x = i * rep + h;
            float l = 0.0f;
            for (int j = 0; j < KB; ++j) l += LS[x * KB + j];
            const int64_t base = ((b * a.T + tile.t[i]) * a.nh + kvh * rep + h) * hd;  // out (B, T, nh, hd)
            for (int64_t d = 0; d < hd; ++d) {
                const float value = O[x * hd + d] / l;
                if (a.dtype == 1) static_cast<uint16_t*>(a.out)[base + d] = f32_to_bf16(value);
                else static_cast<float*>(a.out)[base + d] = value;
            }
        }
    }
}

}  // namespace

extern "C" {

int lmcli_attention_version() { return 1; }

// q (B, nh, T, hd), k and v (B, nkv, S, hd) with the given strides (d contiguous), float32 (dtype 0)
// or bfloat16 (1); keys [B, L] int64, first and end [B, T] int64 (a query with end <= first is a pad:
// output 0); out (B, T, nh, hd) contiguous, in the inputs' dtype. softcap 0: none. Returns 0, or 1 for
// arguments it does not take.
int lmcli_attend(const void* q, const void* k, const void* v, void* out, int dtype,
                 int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                 const int64_t* q_strides, const int64_t* k_strides, const int64_t* v_strides,
                 const int64_t* keys, int64_t L, const int64_t* first, const int64_t* end,
                 float scale, float softcap, int threads) {
    if (hd <= 0 || hd > MAX_HD || nkv <= 0 || nh % nkv || (dtype != 0 && dtype != 1)) return 1;
    Args a{q, k, v, out, dtype, B, T, nh, nkv, hd, {}, {}, {}, keys, L, first, end, scale, softcap};
    for (int i = 0; i < 3; ++i) { a.qs[i] = q_strides[i]; a.ks[i] = k_strides[i]; a.vs[i] = v_strides[i]; }
    std::vector<Tile> tiles;
    for (int64_t b = 0; b < B; ++b) {
        Tile run{b, 0, 0, {}};
        for (int64_t t = 0; t <= T; ++t) {
            const bool pad = t < T && end[b * T + t] <= first[b * T + t];
            if (t < T && pad) {
                const size_t row = static_cast<size_t>(nh * hd) * (dtype == 1 ? 2 : 4);
                std::memset(static_cast<char*>(out) + (b * T + t) * row, 0, row);
            }
            const bool joins = t < T && !pad && run.count > 0 && run.count < TQ
                               && first[b * T + t] == first[b * T + run.t[0]];
            if (joins) { run.t[run.count++] = t; continue; }
            if (run.count > 0)
                for (int64_t h = 0; h < nkv; ++h) { run.kvh = h; tiles.push_back(run); }
            run.count = 0;
            if (t < T && !pad) run.t[run.count++] = t;
        }
    }
    const int64_t n = static_cast<int64_t>(tiles.size());
    int64_t work = 0;  // multiply-adds, roughly: a small call (a decode step) stays on this thread
    for (const Tile& tile : tiles) {
        const int64_t f = first[tile.b * T + tile.t[0]];
        work += (end[tile.b * T + tile.t[tile.count - 1]] - f) * tile.count * (nh / nkv) * hd * 2;
    }
    if (n < 2 || work < (int64_t(1) << 22)) threads = 1;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (threads > 1)
    {
        std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) run_tile(a, tiles[static_cast<size_t>(i)], work);
    }
    return 0;
}

}  // extern "C"
