// The attention backward's row preprocessing, one launch before the main kernel of the 16-bit
// backward (attention_bwd.cu; the Hopper kernel's too) and of the float32 ones
// (attention_f32.cu, attention_tf32.cu): per query row, lse in log2 units (+inf for a row
// with no allowed key, so its P is exactly 0) and delta = rowsum(dO * O) - dlse (the lse's
// cotangent, where the loss uses the lse), both padded to whole query tiles: of each
// (batch, head) of a dense batch (sk_attn_bwd_pre), of each sequence of packed ones
// (sk_attn_bwd_pre_varlen).
#pragma once
#include "common.cuh"

#ifndef SK_LOG2E
#define SK_LOG2E 1.4426950408889634f
#endif

// The threads per row of the row preprocessing: D / 8 (one chunk of 8 elements each) rounded
// up to a power of two (the extra threads of a row load nothing).
__host__ __device__ constexpr int sk_pre_group(int d) {
    int g = 1;
    while (g < d / 8) g *= 2;
    return g;
}

// A row of sk_attn_bwd_pre, its G threads each holding 8 elements (16 bytes of a 16-bit
// type, 32 of float32: one or two vector loads); the row's lse is lse[at] (and its cotangent
// dlse[at], where dlse is given); `o()` and `g()` say where this thread's elements of O and dO
// are, asked only for a live row (`row`) with an allowed key and a thread with a chunk
// (`chunk`): delta = sum(dO * O) reduced over the group, less dlse, and lse2 = lse * log2 e,
// written at r by the group's first thread (c == 0) of a row in the grid (`live`); a padding
// row or one with no allowed key (lse -inf) gets +inf and 0, whatever its dlse.
template <typename T, int G, typename O, typename Gr>
__device__ __forceinline__ void sk_bwd_pre_row(const float* lse, const float* dlse,
                                               long long at, O o, Gr g, bool row, bool chunk,
                                               bool live, int c, long long r, float* lse2,
                                               float* delta) {
    constexpr int PER = 16 / sizeof(T);  // elements per 16-byte load
    float l = SK_INF, acc = 0.0f;
    if (row) l = lse[at];
    if (row && l != -SK_INF && chunk) {
#pragma unroll
        for (int w = 0; w < 8 / PER; ++w) {
            const uint4 ov = reinterpret_cast<const uint4*>(o())[w];
            const uint4 gv = reinterpret_cast<const uint4*>(g())[w];
            const T* op = reinterpret_cast<const T*>(&ov);
            const T* gp = reinterpret_cast<const T*>(&gv);
#pragma unroll
            for (int e = 0; e < PER; ++e) acc += sk_to_float(op[e]) * sk_to_float(gp[e]);
        }
    }
#pragma unroll
    for (int off = G / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (live && c == 0) {
        const bool empty = !row || l == -SK_INF;
        lse2[r] = empty ? SK_INF : l * SK_LOG2E;
        delta[r] = empty ? 0.0f : acc - (dlse != nullptr ? dlse[at] : 0.0f);
    }
}

// One group of sk_pre_group(D) threads per row of [B * Hq, lq_pad]: lse2 = lse * log2 e (+inf
// where lse is -inf or the row is padding), delta = sum(dO * O) - dlse (0 there); lse and dlse
// (or null: no cotangent) [B * Hq, Lq] contiguous.
template <typename T, int D>
__global__ void __launch_bounds__(256) sk_attn_bwd_pre(
    const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ dlse, float* __restrict__ lse2, float* __restrict__ delta,
    long long o_sb, long long o_sh, long long o_sl, long long g_sb, long long g_sh,
    long long g_sl, int hq, int lq, int lq_pad, long long rows) {
    constexpr int G = sk_pre_group(D);
    const long long r = (static_cast<long long>(blockIdx.x) * 256 + threadIdx.x) / G;
    const int c = threadIdx.x % G;
    const bool chunk = G == D / 8 || c < D / 8;  // a thread with a chunk of the row
    const bool live = r < rows;
    const long long bh = live ? r / lq_pad : 0;
    const int i = live ? static_cast<int>(r % lq_pad) : 0;
    const int b = static_cast<int>(bh / hq), h = static_cast<int>(bh % hq);
    const bool row = live && i < lq;
    sk_bwd_pre_row<T, G>(lse, dlse, bh * lq + i,
                         [&] { return out + b * o_sb + h * o_sh + i * o_sl + c * 8; },
                         [&] { return dout + b * g_sb + h * g_sh + i * g_sl + c * 8; }, row,
                         chunk, live, c, r, lse2, delta);
}

// The sequence b whose span cu[b] <= x < cu[b + 1] holds x, for cumulative offsets cu [B + 1]
// and 0 <= x < cu[B] (empty spans, cu[b] == cu[b + 1], never hold x).
__device__ __forceinline__ int sk_sequence_of(const long long* __restrict__ cu, int batches,
                                              long long x) {
    int lo = 0, hi = batches;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (cu[mid] <= x) lo = mid; else hi = mid;
    }
    return lo;
}

// sk_attn_bwd_pre for packed sequences: one group of sk_pre_group(D) threads per row of
// [Hq, tpad], the rows of sequence b starting at cu_pad[b] in each head's tpad rows; out, dout
// [Tq, Hq, D] by token and head strides, lse and dlse (or null) [Tq, Hq] contiguous.
template <typename T, int D>
__global__ void __launch_bounds__(256) sk_attn_bwd_pre_varlen(
    const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ dlse, float* __restrict__ lse2, float* __restrict__ delta,
    const long long* __restrict__ cu_q, const long long* __restrict__ cu_pad, long long o_st,
    long long o_sh, long long g_st, long long g_sh, int hq, int batches, int tpad,
    long long rows) {
    constexpr int G = sk_pre_group(D);
    const long long r = (static_cast<long long>(blockIdx.x) * 256 + threadIdx.x) / G;
    const int c = threadIdx.x % G;
    const bool chunk = G == D / 8 || c < D / 8;  // a thread with a chunk of the row
    const bool live = r < rows;
    const int h = live ? static_cast<int>(r / tpad) : 0;
    const long long p = live ? r % tpad : 0;
    const int b = sk_sequence_of(cu_pad, batches, p);
    const long long tok = cu_q[b] + (p - cu_pad[b]);
    const bool row = live && tok < cu_q[b + 1];
    sk_bwd_pre_row<T, G>(lse, dlse, tok * hq + h,
                         [&] { return out + tok * o_st + h * o_sh + c * 8; },
                         [&] { return dout + tok * g_st + h * g_sh + c * 8; }, row,
                         chunk, live, c, r, lse2, delta);
}
