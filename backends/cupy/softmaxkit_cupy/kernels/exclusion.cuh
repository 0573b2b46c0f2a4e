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

// Forward: set the excluded scores of a warp's [16 MT x 8 NB] tile (rows = queries, columns
// = keys, C fragment layout) to -inf: keys past lk, keys outside the causal / window limits,
// and keys the boolean mask excludes.
// j0 is the lane's first key, rel0 its first key minus (its first query + offset), i0 its first
// query; element (mt, nb, e) adds nb * 8 + (e & 1) to the key and 16 mt + 8 (e >= 2) to the
// query.  Everything is relative to values that change per tile, so nothing is kept live
// across the key loop.
template <int MT, int NB>
__device__ __forceinline__ void sk_exclude(float (&s)[MT][NB][4], int j0, int lk, int rel0,
                                           int lo, int hi, const unsigned char* mb, int i0,
                                           int lq, long long m_sq, long long m_sk) {
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
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = i0 + 16 * mt + 8 * r;
            if (i >= lq) continue;  // a row past lq is never stored
            const unsigned char* row = mb + i * m_sq;
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = j0 + nb * 8 + e;
                    if (j < lk && !row[j * m_sk]) s[mt][nb][2 * r + e] = -SK_INF;
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
                                             int lo, int hi, const unsigned char* mb, int i0,
                                             int lq, long long m_sq, long long m_sk) {
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
    // one query column (two lanes' worth of keys) at a time, as in sk_exclude
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int i = i0 + nb * 8 + c;
            const unsigned char* row = mb + min(i, lq - 1) * m_sq;
            const bool k0 = j0 < lk && row[j0 * m_sk];
            const bool k1 = j0 + 8 < lk && row[(j0 + 8) * m_sk];
            if (!k0) s[nb][c] = -SK_INF;
            if (!k1) s[nb][2 + c] = -SK_INF;
        }
    }
}
