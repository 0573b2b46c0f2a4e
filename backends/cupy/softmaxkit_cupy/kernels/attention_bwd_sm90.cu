// Attention backward for Hopper (sm_90a): warpgroup matrix products (wgmma.mma_async).
//
// sk_attn_bwd_sm90 takes the arguments of sk_attn_bwd (attention_bwd.cu) and computes the
// same: with lse2 and delta from sk_attn_bwd_pre, P = exp2(scale S log2 e - lse2) (scores capped
// first where asked), dV = P^T dO, dP = dO V^T, dS = P (dP - delta) (times 1 - tanh^2 under
// softcap), dK = scale dS^T Q written to dk, and dS K added unscaled into the float32 dq_acc
// that sk_attn_bwd_dq scales and rounds.  Excluded pairs get P = 0 and dS = 0.
//
// One block owns BN = 64 WG keys of one (batch, key head) and streams the query tiles (BM = 64
// rows) of every query head of the group through two cp.async stages.  Warpgroup w owns keys
// [64 w, 64 w + 64): S^T = K_w Q^T and dP^T = V_w dO^T are wgmma products with both operands
// in shared memory (swizzled panels, wgmma.cuh: of 64 columns, or of 32 where a warpgroup's
// columns are not whole 64-column panels, at D = 32, 96 and 192), P^T and dS^T stay in
// registers as the A operands of dV_w += P^T dO and dK_w += dS^T Q (dO and Q read MN-major),
// whose float32 accumulators live in registers across the query loop.  dS^T also goes to
// shared memory for dQ = dS K (A and B read MN-major): at D = 128 warpgroup w computes dQ's 64
// columns of panel w over all BN keys, at 32, 64 and 96 all columns over its own keys; the
// results are added into dq_acc with vector reductions.
//
// Above D = 128 a warpgroup's dK and dV (D floats a thread each) would not fit in registers:
// there (COLSPLIT) the warpgroups share one tile of 64 keys and split the head dimension,
// warpgroup w owning columns [D / WG w, D / WG (w + 1)) of dK, dV and dQ.  Each computes the
// whole S^T and dP^T of the 64 keys (the same products, so their registers stay those of
// D = 128); warpgroup 0 writes dS^T for dQ, which each warpgroup computes for its columns
// (64 at a time at 256, all 96 at once at 192).
#include "wgmma.cuh"
#include "mma.cuh"
#include "exclusion.cuh"

#ifndef SK_LOG2E
#define SK_LOG2E 1.4426950408889634f
#endif

// The layouts are sk_attn_bwd_body's (attention_bwd.cu): dense (VARLEN = false) q, dO
// [B, Hq, Lq, D] and k, v [B, Hk, Lk, D] by element strides, lse2, delta [B * Hq, lq_pad],
// dq_acc [B * Hq, lq_pad, D]; packed (VARLEN = true) q, dO [Tq, Hq, D] and k, v [Tk, Hk, D] by
// token and head strides, block z sequence b, whose rows of lse2, delta and dq_acc start at
// its padded offset cu_pad[b] within each head's lq_pad (= Tpad) rows, lq, lk and the causal
// offset its own (``offset`` 1 for bottom-right alignment), dk, dv [Tk, Hk, D].
template <typename T, int D, int WG, bool MASK, bool VARLEN>
__device__ __forceinline__ void sk_attn_bwd_sm90_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const unsigned* __restrict__ mask,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    T* __restrict__ dk, T* __restrict__ dv, const long long* __restrict__ cu_q,
    const long long* __restrict__ cu_k, const long long* __restrict__ cu_pad, long long q_sb,
    long long q_sh, long long q_sl, long long k_sb, long long k_sh, long long k_sl,
    long long v_sb, long long v_sh, long long v_sl, long long g_sb, long long g_sh,
    long long g_sl, long long m_sb, long long m_sh, long long m_sq, int hq, int hk, int lq,
    int lk, int lq_pad, float scale, float softcap, int offset, int causal, int left,
    int right) {
    constexpr int BM = 64;
    constexpr bool COLSPLIT = D > 128;  // the warpgroups split the columns of one key tile
    constexpr int BN = COLSPLIT ? 64 : 64 * WG;
    constexpr int THREADS = 128 * WG;
    constexpr int DW = COLSPLIT ? D / WG : D;  // dK and dV columns of a warpgroup
    constexpr int NS = BM / 2;   // S^T (and dP^T) accumulators per thread
    constexpr int NA = DW / 2;   // dK (and dV) accumulators per thread
    constexpr int KM = BM / 16;  // k-slices over the tile's queries
    constexpr int KD = D / 16;   // k-slices over the head dimension
    // the operand tiles' panels (wgmma.cuh): 64 columns of 128-byte rows, or 32 columns of
    // 64-byte rows where a warpgroup's columns are not whole 64-column panels (D = 32, 96, and
    // 192 split in two); dS^T is one panel of BM = 64 queries, 128-byte rows, at every D
    constexpr int PC = sk_panel_cols<DW>;
    constexpr int RB = 2 * PC;                                  // bytes of a panel's row
    constexpr int KSP = RB / 32;                                // k-slices of 16 in a panel
    constexpr unsigned PANEL_Q = BM * RB, PANEL_K = BN * RB;    // bytes of a panel
    constexpr unsigned QTILE = BM * D * 2, KTILE = BN * D * 2;  // bytes of a tile
    // dQ: where D = 64 WG the warpgroups split its columns (a panel each) over every key of
    // the block, elsewhere below COLSPLIT each takes all columns over its own keys (dq_acc
    // adds the halves); under COLSPLIT each takes its DW columns over the block's keys.  A
    // warpgroup's columns are QPASSES products of QN columns.
    constexpr bool QSPLIT = D == 64 * WG;
    constexpr int KQ = (QSPLIT || COLSPLIT ? BN : 64) / 16;  // k-slices of dQ's product
    constexpr int DQ_COLS = COLSPLIT ? DW : QSPLIT ? 64 : D;
    constexpr int QN = DQ_COLS % 64 == 0 ? 64 : DQ_COLS <= 96 ? DQ_COLS : 32;
    constexpr int QPASSES = DQ_COLS / QN;
    static_assert(DW % PC == 0 && DQ_COLS % QN == 0 && QN % PC == 0, "dQ's warpgroup split");
    typedef SkMma<T> Mma;

    extern __shared__ unsigned char sk_smem_raw[];
    const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(sk_smem_raw));
    const unsigned ak = (raw + 1023u) & ~1023u;  // the panels' swizzle needs 1024-byte alignment
    const unsigned av = ak + KTILE, aq = av + KTILE, ag = aq + 2 * QTILE, ads = ag + 2 * QTILE;
    T* sk = reinterpret_cast<T*>(sk_smem_raw + (ak - raw));
    T* sv = sk + BN * D;
    T* sq = sv + BN * D;        // 2 stages
    T* sg = sq + 2 * BM * D;    // dO, 2 stages
    T* sds = sg + 2 * BM * D;   // dS^T [BN keys x BM queries], one panel
    float* sl = reinterpret_cast<float*>(sds + BN * BM);  // lse2, 2 stages
    float* sd = sl + 2 * BM;                               // delta, 2 stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4, wg = threadIdx.x / 128;
    // this warp's first key in the tile (its accumulator rows)
    const int w0 = (COLSPLIT ? warp % 4 : warp) * 16;
    const int n0 = blockIdx.x * BN, kh = blockIdx.y, b = blockIdx.z;
    const int group = hq / hk;
    const T *kb, *vb;
    // packed: the sequence's first query token and first padded row of the work arrays,
    // added to the offsets below (the kernel's pointer parameters stay as given: moved, they
    // would take registers across the loop, which at D = 256 spill)
    long long q_tok = 0, p_row = 0;
    if constexpr (VARLEN) {
        const long long k_tok = cu_k[b];
        q_tok = cu_q[b];
        p_row = cu_pad[b];
        lq = static_cast<int>(cu_q[b + 1] - q_tok);
        lk = static_cast<int>(cu_k[b + 1] - k_tok);
        offset = offset ? lk - lq : 0;
        // the grid covers the longest sequence's keys; a sequence without queries still
        // writes its keys' zero gradients below
        if (n0 >= lk) return;
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
        const long long qo =
            (VARLEN ? q_tok * q_sl : b * q_sb) + h * q_sh + static_cast<long long>(m0) * q_sl;
        const long long go =
            (VARLEN ? q_tok * g_sl : b * g_sb) + h * g_sh + static_cast<long long>(m0) * g_sl;
        const long long ro =
            (VARLEN ? h : static_cast<long long>(b) * hq + h) * lq_pad + p_row + m0;
        // at D = 256 the copies' addresses, held across the loop, would spill registers
        const int tid = COLSPLIT ? sk_opaque_tid() : static_cast<int>(threadIdx.x);
        sk_load_panels<T, BM, D, THREADS, PC>(sq + st * BM * D, q + qo, q_sl, lq - m0, tid);
        sk_load_panels<T, BM, D, THREADS, PC>(sg + st * BM * D, dout + go, g_sl, lq - m0, tid);
        if (threadIdx.x < BM / 2) {  // BM / 4 chunks of each
            const int c = threadIdx.x;
            const bool is_l = c < BM / 4;
            const int cc = is_l ? c : c - BM / 4;
            float* dst = (is_l ? sl : sd) + st * BM + 4 * cc;
            sk_cp_async16(dst, (is_l ? lse2 : delta) + ro + 4 * cc, true);
        }
    };

    float dk_acc[NA], dv_acc[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) dk_acc[i] = dv_acc[i] = 0.0f;
    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const float th_scale = softcap > 0.0f ? 1.0f / (softcap * SK_LOG2E) : 0.0f;
    int rel_lo, rel_hi;
    sk_relative_limits(causal, left, right, rel_lo, rel_hi);

    // descriptors: K_w and V_w as K-major A (this warpgroup's 64 rows), Q and dO stage 0 as
    // K-major B (S^T, dP^T) and MN-major B (dK, dV), dS^T and K as MN-major A and B of dQ
    // (under COLSPLIT the keys are every warpgroup's, and dO and Q start at its columns' panels)
    const unsigned key_rows = COLSPLIT ? 0u : wg * 64 * RB;
    const unsigned col_panels = COLSPLIT ? wg * (DW / PC) * PANEL_Q : 0u;
    const unsigned long long d_k = sk_desc(ak + key_rows, 16, 8 * RB, RB);
    const unsigned long long d_v = sk_desc(av + key_rows, 16, 8 * RB, RB);
    const unsigned long long d_q = sk_desc(aq, 16, 8 * RB, RB);
    const unsigned long long d_g = sk_desc(ag, 16, 8 * RB, RB);
    const unsigned long long d_qt = sk_desc(aq + col_panels, PANEL_Q, 8 * RB, RB);
    const unsigned long long d_gt = sk_desc(ag + col_panels, PANEL_Q, 8 * RB, RB);
    const unsigned long long d_ds =
        sk_desc(ads + (QSPLIT || COLSPLIT ? 0u : wg * 64 * 128), BN * 128, 1024);
    // K's panel of dQ's first (or only) QN columns of this warpgroup
    const unsigned long long d_kt = sk_desc(
        ak + (COLSPLIT ? wg * (DW / PC) * PANEL_K : QSPLIT ? wg * PANEL_K : key_rows),
        PANEL_K, 8 * RB, RB);

    if (total > 0) {
        sk_load_panels<T, BN, D, THREADS, PC>(sk, kb, k_sl, lk - n0);
        sk_load_panels<T, BN, D, THREADS, PC>(sv, vb, v_sl, lk - n0);
        load_stage(0, 0);
    }
    sk_cp_async_commit();

    float s[NS], dp[NS], dq[QN / 2];
    unsigned pa[KM][4], da[KM][4];
    // dQ's partial product of query tile m0 of head h (its QN columns from c0), added into
    // the float32 buffer
    auto add_dq = [&](int h, int m0, int c0) {
        const int row = (warp % 4) * 16 + g;
        float* qrow = dq_acc +
            ((VARLEN ? h : static_cast<long long>(b) * hq + h) * lq_pad + p_row + m0 + row) * D;
#pragma unroll
        for (int nb = 0; nb < QN / 8; ++nb) {
            const int col = c0 + nb * 8 + 2 * t;
            sk_red_add2(qrow + col, dq[4 * nb], dq[4 * nb + 1]);
            sk_red_add2(qrow + 8 * D + col, dq[4 * nb + 2], dq[4 * nb + 3]);
        }
    };
    for (int it = 0; it < total; ++it) {
        const int st = it & 1;
        // this stage (and, the first time, K and V) has landed; every warpgroup is done with
        // the other stage, which the copies below overwrite
        sk_cp_async_wait<0>();
        sk_fence_proxy_async();
        __syncthreads();
        if (it + 1 < total) load_stage(it + 1, st ^ 1);
        sk_cp_async_commit();
        const int h = kh * group + it / tiles;
        const int m0 = (t_lo + it % tiles) * BM;
        const unsigned long long qs = st * (QTILE >> 4);

        // S^T = K_w Q^T and dP^T = V_w dO^T (64 keys x BM queries)
        sk_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            const unsigned at = ((kk / KSP) * PANEL_K + (kk % KSP) * 32) >> 4;
            const unsigned bt = ((kk / KSP) * PANEL_Q + (kk % KSP) * 32) >> 4;
            SkWgmma<BM>::ss(s, d_k + at, d_q + qs + bt, kk > 0, T());
        }
        sk_wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            const unsigned at = ((kk / KSP) * PANEL_K + (kk % KSP) * 32) >> 4;
            const unsigned bt = ((kk / KSP) * PANEL_Q + (kk % KSP) * 32) >> 4;
            SkWgmma<BM>::ss(dp, d_v + at, d_g + qs + bt, kk > 0, T());
        }
        sk_wgmma_commit();
        sk_wgmma_wait<0>();
        sk_fence_regs(s);
        sk_fence_regs(dp);

        // scores in log2 units (softcapped: softcap tanh(s / softcap)), exclusions as -inf
        float(&s4)[NS / 4][4] = *reinterpret_cast<float(*)[NS / 4][4]>(&s);
        float(&dp4)[NS / 4][4] = *reinterpret_cast<float(*)[NS / 4][4]>(&dp);
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            float x = s[i] * qk_scale;
            if (softcap > 0.0f) x = sk_softcap_log2(x, softcap, inv_cap);
            s[i] = x;
        }
        const bool edge = n0 + BN > lk || n0 + BN - 1 > m0 + offset + rel_hi ||
                          n0 < m0 + BM - 1 + offset + rel_lo || (MASK && mask != nullptr);
        if (edge) {
            const unsigned* mh = MASK && mask ? mask + b * m_sb + h * m_sh : nullptr;
            const int j0 = n0 + w0 + g, i0 = m0 + 2 * t;
            sk_exclude_t<NS / 4>(s4, j0, lk, j0 - i0 - offset, rel_lo, rel_hi, mh, i0, lq,
                                 m_sq);
        }
        // P^T = exp2(S^T - lse2) and dS^T = P^T (dP^T - delta), times 1 - tanh^2 under
        // softcap (tanh clamped so excluded scores, -inf, give 0, not 0 * inf)
        const float* sls = sl + st * BM;
        const float* sdl = sd + st * BM;
#pragma unroll
        for (int nb = 0; nb < NS / 4; ++nb) {
            const float2 l2 = *reinterpret_cast<const float2*>(sls + nb * 8 + 2 * t);
            const float2 dl = *reinterpret_cast<const float2*>(sdl + nb * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = sk_ex2(s4[nb][e] - ((e & 1) ? l2.y : l2.x));
                const float th = fmaxf(s4[nb][e] * th_scale, -1.0f);
                s4[nb][e] = p;
                dp4[nb][e] = p * (dp4[nb][e] - ((e & 1) ? dl.y : dl.x)) * (1.0f - th * th);
            }
        }
        // P^T and dS^T as the A operands of dV += P^T dO and dK += dS^T Q; dS^T also to
        // shared memory ([key][query], one swizzled panel) for dQ
        unsigned char* dsb = reinterpret_cast<unsigned char*>(sds);
#pragma unroll
        for (int kk = 0; kk < KM; ++kk) {
            sk_pack_a<T>(pa[kk], s4[2 * kk], s4[2 * kk + 1]);
            sk_pack_a<T>(da[kk], dp4[2 * kk], dp4[2 * kk + 1]);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = w0 + g + 8 * (r & 1);  // key
                const int ch = 2 * kk + (r >> 1);       // 8-query chunk
                if (!COLSPLIT || wg == 0)  // under COLSPLIT every warpgroup holds the same
                    *reinterpret_cast<unsigned*>(dsb + row * 128 + ((ch ^ (row & 7)) * 16) +
                                                 4 * t) = da[kk][r];
            }
        }
        sk_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KM; ++kk)
            SkWgmma<DW>::rs(dv_acc, pa[kk], d_gt + qs + ((kk * 16 * RB) >> 4), 1, T());
#pragma unroll
        for (int kk = 0; kk < KM; ++kk)
            SkWgmma<DW>::rs(dk_acc, da[kk], d_qt + qs + ((kk * 16 * RB) >> 4), 1, T());
        sk_wgmma_commit();
        sk_fence_proxy_async();
        __syncthreads();  // dS^T of every warpgroup
        // dQ (BM x QN columns at a time) = dS K, added into the float32 buffer
#pragma unroll
        for (int pass = 0; pass < QPASSES; ++pass) {
            const unsigned long long kt = d_kt + ((pass * (QN / PC) * PANEL_K) >> 4);
            sk_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk)
                SkWgmma<QN>::sst(dq, d_ds + ((kk * 16 * 128) >> 4),
                                 kt + ((kk * 16 * RB) >> 4), kk > 0, T());
            sk_wgmma_commit();
            sk_wgmma_wait<0>();
            sk_fence_regs(dq);
            sk_fence_regs(dv_acc);
            sk_fence_regs(dk_acc);
            sk_fence_regs(pa);
            sk_fence_regs(da);
            add_dq(h, m0, (COLSPLIT ? wg * DW : QSPLIT ? wg * 64 : 0) + pass * QN);
        }
    }
    sk_cp_async_wait<0>();

    // dK (scaled) and dV of this warp's keys; keys of a tile no query sees get zeros
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = n0 + w0 + g + 8 * r;
        if (j < lk) {
            const long long base = VARLEN
                                       ? ((cu_k[b] + j) * hk + kh) * D
                                       : ((static_cast<long long>(b) * hk + kh) * lk + j) * D;
#pragma unroll
            for (int db = 0; db < DW / 8; ++db) {
                const int col = (COLSPLIT ? wg * DW : 0) + db * 8 + 2 * t;
                *reinterpret_cast<unsigned*>(dk + base + col) =
                    Mma::pack(dk_acc[4 * db + 2 * r] * scale, dk_acc[4 * db + 2 * r + 1] * scale);
                *reinterpret_cast<unsigned*>(dv + base + col) =
                    Mma::pack(dv_acc[4 * db + 2 * r], dv_acc[4 * db + 2 * r + 1]);
            }
        }
    }
}

template <typename T, int D, int WG, bool MASK>
__global__ void __launch_bounds__(128 * WG, D == 32 && WG == 1 ? 3 : 1) sk_attn_bwd_sm90(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const unsigned* __restrict__ mask,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    T* __restrict__ dk, T* __restrict__ dv, long long q_sb, long long q_sh, long long q_sl,
    long long k_sb, long long k_sh, long long k_sl, long long v_sb, long long v_sh,
    long long v_sl, long long g_sb, long long g_sh, long long g_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    int lq_pad, float scale, float softcap, int offset, int causal, int left, int right) {
    sk_attn_bwd_sm90_body<T, D, WG, MASK, false>(
        q, k, v, dout, mask, lse2, delta, dq_acc, dk, dv, nullptr, nullptr, nullptr, q_sb, q_sh,
        q_sl, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, g_sb, g_sh, g_sl, m_sb, m_sh, m_sq, hq, hk,
        lq, lk, lq_pad, scale, softcap, offset, causal, left, right);
}

// Packed variable-length backward, the arguments of sk_attn_bwd_varlen (attention_bwd.cu):
// grid (key tiles of the longest sequence, Hk, B).
template <typename T, int D, int WG>
__global__ void __launch_bounds__(128 * WG, D == 32 && WG == 1 ? 3 : 1) sk_attn_bwd_sm90_varlen(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const long long* __restrict__ cu_q,
    const long long* __restrict__ cu_k, const long long* __restrict__ cu_pad,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    T* __restrict__ dk, T* __restrict__ dv, long long q_st, long long q_sh, long long k_st,
    long long k_sh, long long v_st, long long v_sh, long long g_st, long long g_sh, int hq,
    int hk, int tpad, float scale, float softcap, int bottom_right, int causal, int left,
    int right) {
    sk_attn_bwd_sm90_body<T, D, WG, false, true>(
        q, k, v, dout, nullptr, lse2, delta, dq_acc, dk, dv, cu_q, cu_k, cu_pad, 0, q_sh, q_st,
        0, k_sh, k_st, 0, v_sh, v_st, 0, g_sh, g_st, 0, 0, 0, hq, hk, 0, 0, tpad, scale,
        softcap, bottom_right, causal, left, right);
}
