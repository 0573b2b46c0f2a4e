// Attention backward on tensor cores (FlashAttention-2 order), recomputing the probabilities
// from the forward's lse:
//
//   P = exp(S - lse), dV = P^T dO, dP = dO V^T, dS = P * (dP - D) with D = rowsum(dO * O)
//   (times 1 - tanh^2 under softcap), dK = scale dS^T Q, dQ = scale dS K.
//
// sk_attn_bwd_pre writes, per query row, lse in log2 units (+inf for a row with no allowed
// key, so its P is exactly 0) and D, both padded to whole query tiles.  sk_attn_bwd runs one
// block per BN = 16 * WARPS keys of one (batch, key head): the K and V tiles stay in shared
// memory while the query tiles of every query head of the group stream through a two-stage
// cp.async pipeline; warp w owns keys [16 w, 16 w + 16) and accumulates their dK and dV in
// registers (float32), so dK and dV are summed over the group without atomics.  dS goes
// through shared memory once per tile to form dQ's partial product, added into a float32
// buffer with vector reductions; sk_attn_bwd_dq scales it and rounds it to the input dtype.
// The *_varlen kernels do the same for packed variable-length sequences (spec "Packed
// variable-length attention"), each sequence's rows padded to whole query tiles.
#include "mma.cuh"
#include "exclusion.cuh"
#include "bwd_pre.cuh"

// dq [B, Hq, Lq, D] (contiguous) = scale * acc [B, Hq, lq_pad, D]; 8 elements per thread.
template <typename T, int D>
__global__ void __launch_bounds__(256) sk_attn_bwd_dq(
    const float* __restrict__ acc, T* __restrict__ dq, float scale, int lq, int lq_pad,
    long long chunks) {
    const long long c = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
    if (c >= chunks) return;
    const long long e = c * 8, row = e / D;
    const long long bh = row / lq, i = row % lq;
    const float* src = acc + (bh * lq_pad + i) * D + e % D;
    const float4 a = *reinterpret_cast<const float4*>(src);
    const float4 b = *reinterpret_cast<const float4*>(src + 4);
    uint4 o;
    o.x = SkMma<T>::pack(a.x * scale, a.y * scale);
    o.y = SkMma<T>::pack(a.z * scale, a.w * scale);
    o.z = SkMma<T>::pack(b.x * scale, b.y * scale);
    o.w = SkMma<T>::pack(b.z * scale, b.w * scale);
    *reinterpret_cast<uint4*>(dq + e) = o;
}

// dq [Tq, Hq, D] (contiguous) = scale * acc [Hq, tpad, D], token t of sequence b read from row
// cu_pad[b] + t - cu_q[b] of its head; 8 elements per thread.
template <typename T, int D>
__global__ void __launch_bounds__(256) sk_attn_bwd_dq_varlen(
    const float* __restrict__ acc, T* __restrict__ dq, const long long* __restrict__ cu_q,
    const long long* __restrict__ cu_pad, float scale, int hq, int batches, int tpad,
    long long chunks) {
    const long long c = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
    if (c >= chunks) return;
    const long long e = c * 8, row = e / D;
    const long long tok = row / hq;
    const int h = static_cast<int>(row % hq);
    const int b = sk_sequence_of(cu_q, batches, tok);
    const long long p = cu_pad[b] + (tok - cu_q[b]);
    const float* src = acc + (static_cast<long long>(h) * tpad + p) * D + e % D;
    const float4 a = *reinterpret_cast<const float4*>(src);
    const float4 f = *reinterpret_cast<const float4*>(src + 4);
    uint4 o;
    o.x = SkMma<T>::pack(a.x * scale, a.y * scale);
    o.y = SkMma<T>::pack(a.z * scale, a.w * scale);
    o.z = SkMma<T>::pack(f.x * scale, f.y * scale);
    o.w = SkMma<T>::pack(f.z * scale, f.w * scale);
    *reinterpret_cast<uint4*>(dq + e) = o;
}

// The main backward body: block (key tile, key head, batch), BN = 16 * WARPS / SPLIT keys,
// query tiles of BM rows.  Warp w owns keys [16 (w / SPLIT), + 16); above D = 128 two warps
// (SPLIT = 2) share them, each computing their S^T and dP^T in full and accumulating dK and
// dV for its half of the head dimension (w % SPLIT), so the accumulators fit in registers.
// Shared memory: K, V [BN x D]; Q, dO [2][BM x D]; dS^T [BN x BM]; lse2, delta [2][BM]
// (float).
//
// Dense (VARLEN = false): q, dO [B, Hq, Lq, D] and k, v [B, Hk, Lk, D] by element strides;
// lse2, delta [B * Hq, lq_pad] and dq_acc [B * Hq, lq_pad, D]; dk, dv [B, Hk, Lk, D]
// contiguous.  Packed (VARLEN = true): q, dO [Tq, Hq, D] and k, v [Tk, Hk, D] by token and
// head strides; block z is sequence b (queries cu_q[b] .., keys cu_k[b] ..), whose rows of
// lse2, delta and dq_acc start at its padded offset cu_pad[b] (a multiple of BM) within each
// head's ``lq_pad`` (then the total padded length Tpad) rows: lse2, delta [Hq, Tpad] and
// dq_acc [Hq, Tpad, D]; dk, dv [Tk, Hk, D] contiguous.  lq, lk and the causal offset are the
// sequence's own (``offset`` 1 for bottom-right alignment, 0 for top-left), and the blocks
// past its last key return at once.  The dense code path is the one sk_attn_bwd had before
// the packed variant, so the dense kernels compile to the same PTX.
template <typename T, int D, int WARPS, int BM, bool VARLEN>
__device__ __forceinline__ void sk_attn_bwd_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const unsigned* __restrict__ mask,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    T* __restrict__ dk, T* __restrict__ dv, const long long* __restrict__ cu_q,
    const long long* __restrict__ cu_k, const long long* __restrict__ cu_pad,
    long long q_sb, long long q_sh, long long q_sl,
    long long k_sb, long long k_sh, long long k_sl, long long v_sb, long long v_sh,
    long long v_sl, long long g_sb, long long g_sh, long long g_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    int lq_pad, float scale, float softcap, int offset, int causal, int left, int right) {
    constexpr int SPLIT = D > 128 ? 2 : 1;
    constexpr int BN = 16 * WARPS / SPLIT;
    constexpr int THREADS = WARPS * 32;
    constexpr int NB = BM / 8;            // n-blocks of S^T (query columns)
    constexpr int DB = D / 8 / SPLIT;     // n-blocks of the warp's dK, dV columns
    // dQ's [BM x D] partial product: WM x WN warps, each 16 rows x D / WN columns, computed
    // in passes of at most 64 columns (32 accumulators; 48 or 80 where 64 does not divide)
    constexpr int WM = BM / 16;
    constexpr int WN = WARPS / WM;
    constexpr int QCOLS = D / WN;
    constexpr int PCOLS = QCOLS <= 64        ? QCOLS
                          : QCOLS % 64 == 0 ? 64
                          : QCOLS % 48 == 0 ? 48
                          : QCOLS % 80 == 0 ? 80
                                            : QCOLS;
    static_assert(WARPS % WM == 0 && QCOLS % PCOLS == 0 && PCOLS % 16 == 0, "dQ warp layout");
    static_assert(WARPS % SPLIT == 0 && DB % 2 == 0, "dK, dV warp layout");
    typedef SkMma<T> Mma;
    extern __shared__ __align__(16) unsigned char sk_smem[];
    T* sk = reinterpret_cast<T*>(sk_smem);
    T* sv = sk + BN * D;
    T* sq = sv + BN * D;       // 2 stages
    T* sg = sq + 2 * BM * D;   // dO, 2 stages
    T* sds = sg + 2 * BM * D;  // dS^T
    float* sl = reinterpret_cast<float*>(sds + BN * BM);  // lse2, 2 stages
    float* sd = sl + 2 * BM;                               // delta, 2 stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * BN, kh = blockIdx.y, b = blockIdx.z;
    const int group = hq / hk;
    const T *kb, *vb;
    if constexpr (VARLEN) {
        const long long q_tok = cu_q[b], k_tok = cu_k[b], p_row = cu_pad[b];
        lq = static_cast<int>(cu_q[b + 1] - q_tok);
        lk = static_cast<int>(cu_k[b + 1] - k_tok);
        offset = offset ? lk - lq : 0;
        // the grid covers the longest sequence's keys; a sequence without queries still
        // writes its keys' zero gradients below
        if (n0 >= lk) return;
        // every array from the sequence's first token (first padded row for the work arrays)
        q += q_tok * q_sl;
        dout += q_tok * g_sl;
        lse2 += p_row;
        delta += p_row;
        dq_acc += p_row * D;
        dk += k_tok * hk * D;
        dv += k_tok * hk * D;
        kb = k + (k_tok + n0) * k_sl + kh * k_sh;
        vb = v + (k_tok + n0) * v_sl + kh * v_sh;
    } else {
        kb = k + b * k_sb + kh * k_sh + static_cast<long long>(n0) * k_sl;
        vb = v + b * v_sb + kh * v_sh + static_cast<long long>(n0) * v_sl;
    }

    int m_lo, m_hi;  // query rows any key of this tile may be seen by
    sk_seeing_queries(n0, min(n0 + BN, lk), lq, offset, causal, left, right, m_lo, m_hi);
    const int t_lo = m_lo / BM;
    const int tiles = m_hi > m_lo ? (m_hi + BM - 1) / BM - t_lo : 0;
    const int total = group * tiles;

    auto load_stage = [&](int it, int st) {
        const int h = kh * group + it / tiles;
        const int m0 = (t_lo + it % tiles) * BM;
        long long qo, go, ro;
        if constexpr (VARLEN) {
            qo = static_cast<long long>(m0) * q_sl + h * q_sh;
            go = static_cast<long long>(m0) * g_sl + h * g_sh;
            ro = static_cast<long long>(h) * lq_pad + m0;
        } else {
            qo = b * q_sb + h * q_sh + static_cast<long long>(m0) * q_sl;
            go = b * g_sb + h * g_sh + static_cast<long long>(m0) * g_sl;
        }
        sk_load_tile<T, BM, D, THREADS>(sq + st * BM * D, q + qo, q_sl, lq - m0);
        sk_load_tile<T, BM, D, THREADS>(sg + st * BM * D, dout + go, g_sl, lq - m0);
        if constexpr (!VARLEN) ro = (static_cast<long long>(b) * hq + h) * lq_pad + m0;
        for (int c = threadIdx.x; c < BM / 2; c += THREADS) {  // BM / 4 chunks of each
            const bool is_l = c < BM / 4;
            const int cc = is_l ? c : c - BM / 4;
            float* dst = (is_l ? sl : sd) + st * BM + 4 * cc;
            sk_cp_async16(dst, (is_l ? lse2 : delta) + ro + 4 * cc, true);
        }
    };

    float dk_acc[DB][4], dv_acc[DB][4];
#pragma unroll
    for (int i = 0; i < DB; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[i][e] = dv_acc[i][e] = 0.0f;
    }
    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    int rel_lo, rel_hi;
    sk_relative_limits(causal, left, right, rel_lo, rel_hi);
    const int w0 = warp / SPLIT * 16;        // this warp's first key in the tile
    const int dc0 = warp % SPLIT * (D / SPLIT);  // its first column of dK and dV

    if (total > 0) {
        sk_load_tile<T, BN, D, THREADS>(sk, kb, k_sl, lk - n0);
        sk_load_tile<T, BN, D, THREADS>(sv, vb, v_sl, lk - n0);
        load_stage(0, 0);
    }
    sk_cp_async_commit();

    for (int it = 0; it < total; ++it) {
        const int st = it & 1;
        if (it + 1 < total) load_stage(it + 1, st ^ 1);
        sk_cp_async_commit();
        sk_cp_async_wait<1>();  // this stage (and, the first time, K and V) has landed
        __syncthreads();
        const int h = kh * group + it / tiles;
        const int m0 = (t_lo + it % tiles) * BM;
        const T* sqs = sq + st * BM * D;
        const T* sgs = sg + st * BM * D;

        // dP^T = V_w dO^T and S^T = K_w Q^T: 16 keys x BM queries per warp
        float dp[NB][4], s[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] = 0.0f;
        }
        sk_mma_abt<T, D, NB>(dp, sv, w0, sgs);
        sk_mma_abt<T, D, NB>(s, sk, w0, sqs);

        // scores in log2 units (softcapped: softcap tanh(s / softcap)), exclusions as -inf
        const float* sls = sl + st * BM;
        const float* sdl = sd + st * BM;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[nb][e] * qk_scale;
                if (softcap > 0.0f) x = sk_softcap_log2(x, softcap, inv_cap);
                s[nb][e] = x;
            }
        }
        const bool edge = n0 + BN > lk || n0 + BN - 1 > m0 + offset + rel_hi ||
                          n0 < m0 + BM - 1 + offset + rel_lo || mask != nullptr;
        if (edge) {
            const unsigned* mh = mask ? mask + b * m_sb + h * m_sh : nullptr;
            const int j0 = n0 + w0 + g, i0 = m0 + 2 * t;
            sk_exclude_t<NB>(s, j0, lk, j0 - i0 - offset, rel_lo, rel_hi, mh, i0, lq, m_sq);
        }
        // P^T = exp2(S^T - lse2) and dS^T = P^T (dP^T - delta), times 1 - tanh^2 under
        // softcap (tanh clamped so excluded scores, -inf, give 0, not 0 * inf)
        const float th_scale = softcap > 0.0f ? 1.0f / (softcap * SK_LOG2E) : 0.0f;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int ci = nb * 8 + 2 * t + (e & 1);  // query column in the tile
                const float p = sk_ex2(s[nb][e] - sls[ci]);
                const float th = fmaxf(s[nb][e] * th_scale, -1.0f);
                s[nb][e] = p;
                dp[nb][e] = p * (dp[nb][e] - sdl[ci]) * (1.0f - th * th);
            }
        }

        // dV_w += P^T dO and dK_w += dS^T Q (k = the tile's queries)
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            unsigned pa[4], da[4];
            sk_pack_a<T>(pa, s[2 * kk], s[2 * kk + 1]);
            sk_pack_a<T>(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
            for (int db = 0; db < DB; db += 2) {
                unsigned bf[4];
                sk_frag<SK_BT, D>(bf, sgs, kk * 16, dc0 + db * 8);
                sk_mma_pair<T>(dv_acc[db], dv_acc[db + 1], pa, bf);
                sk_frag<SK_BT, D>(bf, sqs, kk * 16, dc0 + db * 8);
                sk_mma_pair<T>(dk_acc[db], dk_acc[db + 1], da, bf);
            }
            // dS^T to shared memory ([key][query]) for dQ (by one warp of the keys)
            if (SPLIT > 1 && dc0 != 0) continue;
            *reinterpret_cast<unsigned*>(sds + sk_swz<BM>(w0 + g, kk * 16 + 2 * t)) = da[0];
            *reinterpret_cast<unsigned*>(sds + sk_swz<BM>(w0 + g + 8, kk * 16 + 2 * t)) = da[1];
            *reinterpret_cast<unsigned*>(sds + sk_swz<BM>(w0 + g, kk * 16 + 8 + 2 * t)) = da[2];
            *reinterpret_cast<unsigned*>(sds + sk_swz<BM>(w0 + g + 8, kk * 16 + 8 + 2 * t)) =
                da[3];
        }
        __syncthreads();

        // dQ[BM x D] += dS K (unscaled), added into the float32 buffer
        {
            const int wm = warp % WM, wn = warp / WM;
            float* qrow = VARLEN
                ? dq_acc + (static_cast<long long>(h) * lq_pad + m0 + wm * 16 + g) * D
                : dq_acc + ((static_cast<long long>(b) * hq + h) * lq_pad + m0 +
                            wm * 16 + g) * D;
#pragma unroll
            for (int pass = 0; pass < QCOLS / PCOLS; ++pass) {
                const int c0 = wn * QCOLS + pass * PCOLS;
                float acc[PCOLS / 8][4];
#pragma unroll
                for (int i = 0; i < PCOLS / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    unsigned af[4];
                    sk_frag<SK_AT, BM>(af, sds, kk * 16, wm * 16);
#pragma unroll
                    for (int nb = 0; nb < PCOLS / 8; nb += 2) {
                        unsigned bf[4];
                        sk_frag<SK_BT, D>(bf, sk, kk * 16, c0 + nb * 8);
                        sk_mma_pair<T>(acc[nb], acc[nb + 1], af, bf);
                    }
                }
#pragma unroll
                for (int nb = 0; nb < PCOLS / 8; ++nb) {
                    const int col = c0 + nb * 8 + 2 * t;
                    sk_red_add2(qrow + col, acc[nb][0], acc[nb][1]);
                    sk_red_add2(qrow + 8 * D + col, acc[nb][2], acc[nb][3]);
                }
            }
        }
    }
    sk_cp_async_wait<0>();

    // dK (scaled) and dV of this warp's keys; keys of a tile no query sees get zeros
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = n0 + w0 + g + 8 * r;
        if (j < lk) {
            const long long base = VARLEN
                                       ? (static_cast<long long>(j) * hk + kh) * D
                                       : ((static_cast<long long>(b) * hk + kh) * lk + j) * D;
#pragma unroll
            for (int db = 0; db < DB; ++db) {
                const int col = dc0 + db * 8 + 2 * t;
                *reinterpret_cast<unsigned*>(dk + base + col) =
                    Mma::pack(dk_acc[db][2 * r] * scale, dk_acc[db][2 * r + 1] * scale);
                *reinterpret_cast<unsigned*>(dv + base + col) =
                    Mma::pack(dv_acc[db][2 * r], dv_acc[db][2 * r + 1]);
            }
        }
    }
}

template <typename T, int D, int WARPS, int BM>
__global__ void __launch_bounds__(WARPS * 32) sk_attn_bwd(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const unsigned* __restrict__ mask,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    T* __restrict__ dk, T* __restrict__ dv, long long q_sb, long long q_sh, long long q_sl,
    long long k_sb, long long k_sh, long long k_sl, long long v_sb, long long v_sh,
    long long v_sl, long long g_sb, long long g_sh, long long g_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    int lq_pad, float scale, float softcap, int offset, int causal, int left, int right) {
    sk_attn_bwd_body<T, D, WARPS, BM, false>(
        q, k, v, dout, mask, lse2, delta, dq_acc, dk, dv, nullptr, nullptr, nullptr, q_sb,
        q_sh, q_sl, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, g_sb, g_sh, g_sl, m_sb, m_sh, m_sq,
        hq, hk, lq, lk, lq_pad, scale, softcap, offset, causal, left, right);
}

// Packed variable-length backward: grid (key tiles of the longest sequence, Hk, B); q, dO
// [Tq, Hq, D], k, v [Tk, Hk, D] by token and head strides; cu_q, cu_k, cu_pad int64 [B + 1]
// (cu_pad: the query lengths rounded up to BM, summed); lse2, delta [Hq, tpad] and dq_acc
// [Hq, tpad, D] from sk_attn_bwd_pre_varlen; bottom_right as in sk_attn_fwd_varlen.
template <typename T, int D, int WARPS, int BM>
__global__ void __launch_bounds__(WARPS * 32) sk_attn_bwd_varlen(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const long long* __restrict__ cu_q,
    const long long* __restrict__ cu_k, const long long* __restrict__ cu_pad,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    T* __restrict__ dk, T* __restrict__ dv, long long q_st, long long q_sh, long long k_st,
    long long k_sh, long long v_st, long long v_sh, long long g_st, long long g_sh, int hq,
    int hk, int tpad, float scale, float softcap, int bottom_right, int causal, int left,
    int right) {
    sk_attn_bwd_body<T, D, WARPS, BM, true>(
        q, k, v, dout, nullptr, lse2, delta, dq_acc, dk, dv, cu_q, cu_k, cu_pad, 0, q_sh, q_st,
        0, k_sh, k_st, 0, v_sh, v_st, 0, g_sh, g_st, 0, 0, 0, hq, hk, 0, 0, tpad, scale,
        softcap, bottom_right, causal, left, right);
}
