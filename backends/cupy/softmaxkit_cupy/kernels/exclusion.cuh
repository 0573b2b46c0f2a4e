// Which keys a query may attend to (spec "Attention": causal alignment, sliding window,
// keys past Lk, boolean mask), applied to score tiles held in mma.sync C fragments.
#pragma once
#include "common.cuh"

// Allowed keys j of query i, as limits on j - (i + offset): causal keeps j - (i + offset) <= 0,
// a window (left, right) keeps it in [-left, right]; -1 means unbounded.
__device__ __forceinline__ void sk_relative_limits(int causal, int left, int right, int& lo,
                                                   int& hi) {
    hi = right >= 0 ? right : 0x3fffffff;
    if (causal) hi = min(hi, 0);
    lo = left >= 0 ? -left : -0x3fffffff;
}

// Whether key j (of lk) is excluded for a query, rel = j - (query + offset) against the limits
// of sk_relative_limits (the boolean mask aside).
__device__ __forceinline__ bool sk_outside(int j, int lk, int rel, int lo, int hi) {
    return j >= lk || rel > hi || rel < lo;
}

// The keys [lo, hi) that any query of rows [m0, m_end) may see, by causal and window alone
// (a forward block skips the key tiles outside them).
__device__ __forceinline__ void sk_visible_keys(int m0, int m_end, int lk, int offset,
                                                int causal, int left, int right, int& lo,
                                                int& hi) {
    const int last = m_end - 1 + offset;
    lo = 0;
    hi = lk;
    if (causal) hi = min(hi, last + 1);
    if (right >= 0) hi = min(hi, last + right + 1);
    if (left >= 0) lo = max(0, m0 + offset - left);
}

// The causal argument of a float32 forward (attention_f32.cu, attention_tf32.cu) whose grid
// is (heads, batches, row tiles) rather than (row tiles, heads, batches): any nonzero value is
// causal, and this one also says the row tile is the grid's slowest index
// (softmaxkit_cupy.attention.forward_grid).
#define SK_LONGEST_FIRST 2

// The first row m0, head h and batch b of a forward block of BM rows.  Blocks start in the
// order of their linear index, and under causal rows a head's last row tiles see the most
// keys: with the row tile the slowest index (SK_LONGEST_FIRST) every head's last tile starts
// first and the short blocks fill the last wave's gaps.  Otherwise a head's row tiles run
// together, the last first, sharing its K and V in L2.  (Selects of the block's indices, so
// the compiler may read them again rather than hold them.)
__device__ __forceinline__ void sk_row_block(int causal, int BM, int& m0, int& h, int& b) {
    const bool by_tile = causal == SK_LONGEST_FIRST;
    const unsigned tiles = by_tile ? gridDim.z : gridDim.x;
    m0 = static_cast<int>(tiles - 1 - (by_tile ? blockIdx.z : blockIdx.x)) * BM;
    h = by_tile ? blockIdx.x : blockIdx.y;
    b = by_tile ? blockIdx.y : blockIdx.z;
}

// The queries [lo, hi) that may see any key of [n0, n_end), by causal and window alone (a
// backward block skips the query tiles outside them).
__device__ __forceinline__ void sk_seeing_queries(int n0, int n_end, int lq, int offset,
                                                  int causal, int left, int right, int& lo,
                                                  int& hi) {
    const int last = n_end - 1;
    lo = 0;
    hi = lq;
    if (causal) lo = max(lo, n0 - offset);
    if (right >= 0) lo = max(lo, n0 - offset - right);
    if (left >= 0) hi = min(hi, last + left - offset + 1);
}

// Boolean masks reach the kernels packed to bits (kernels/mask_bits.cu): bit j % 32 of word
// j / 32 of a query's row says whether the query may attend to key j; bits past lk are 0.
// A key tile starts at a multiple of 32 keys, so a lane's keys in it fall in known words.

// Forward: set the excluded scores of a warp's [16 MT x 8 NB] tile (rows = queries, columns
// = keys, C fragment layout) to -inf: keys past lk, keys outside the causal / window limits,
// and keys the boolean mask excludes.
// j0 is the lane's first key (the tile's first plus 2 t), rel0 its first key minus (its first
// query + offset), i0 its first query; element (mt, nb, e) adds nb * 8 + (e & 1) to the key
// and 16 mt + 8 (e >= 2) to the query.  Everything is relative to values that change per
// tile, so nothing is kept live across the key loop.
template <int MT, int NB>
__device__ __forceinline__ void sk_exclude(float (&s)[MT][NB][4], int j0, int lk, int rel0,
                                           int lo, int hi, const unsigned* mb, int i0,
                                           int lq, long long m_sq) {
    static_assert(NB % 4 == 0, "a key tile covers whole 32-key mask words");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = j0 + nb * 8 + (e & 1);
                const int rel = rel0 + nb * 8 + (e & 1) - 16 * mt - (e >= 2 ? 8 : 0);
                if (j >= lk || rel > hi || rel < lo) s[mt][nb][e] = -SK_INF;
            }
        }
    }
    if (mb == nullptr) return;
    // key j0 + 8 nb + e is bit (j0 % 32) + 8 (nb % 4) + e of word j0 / 32 + nb / 4
    const int word0 = j0 >> 5, bit0 = j0 & 31;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = i0 + 16 * mt + 8 * r;
            if (i >= lq) continue;  // a row past lq is never stored
            const unsigned* row = mb + i * m_sq;
#pragma unroll
            for (int w = 0; w < NB / 4; ++w) {
                const unsigned word = (word0 + w) * 32 < lk ? row[word0 + w] : 0u;
#pragma unroll
                for (int nb = 0; nb < 4; ++nb) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if (!((word >> (bit0 + 8 * nb + e)) & 1u))
                            s[mt][4 * w + nb][2 * r + e] = -SK_INF;
                    }
                }
            }
        }
    }
}

// Backward: the same for a warp's transposed [16 x 8 NB] tile S^T (rows = keys, columns =
// queries).  j0 is the lane's first key, i0 its first query, rel0 = j0 - (i0 + offset);
// element (nb, e) adds 8 (e >= 2) to the key and nb * 8 + (e & 1) to the query.  Queries past
// lq are left alone (their P is 0 through lse).
template <int NB>
__device__ __forceinline__ void sk_exclude_t(float (&s)[NB][4], int j0, int lk, int rel0,
                                             int lo, int hi, const unsigned* mb, int i0,
                                             int lq, long long m_sq) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = j0 + (e >= 2 ? 8 : 0);
            const int rel = rel0 + (e >= 2 ? 8 : 0) - nb * 8 - (e & 1);
            if (j >= lk || rel > hi || rel < lo) s[nb][e] = -SK_INF;
        }
    }
    if (mb == nullptr) return;
    // keys j0 and j0 + 8 share a mask word: j0 is the tile's first key (a multiple of 32)
    // plus the warp's 16-key offset plus g < 8
    const int word = j0 >> 5, bit = j0 & 31;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int i = i0 + nb * 8 + c;
            const unsigned w = j0 < lk ? mb[min(i, lq - 1) * m_sq + word] : 0u;
            if (!((w >> bit) & 1u)) s[nb][c] = -SK_INF;
            if (!((w >> (bit + 8)) & 1u)) s[nb][2 + c] = -SK_INF;
        }
    }
}
