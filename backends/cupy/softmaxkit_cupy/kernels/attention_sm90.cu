// Attention forward for Hopper (sm_90a): warpgroup matrix products (wgmma.mma_async).
//
// The arguments, results and numerics are those of sk_attn_fwd in attention.cu: scores in
// log2 units (scale * log2 e folded in), float32 accumulation, excluded keys (causal, window,
// boolean mask, past Lk) scoring -inf, and a row with no allowed key ending as out 0, lse -inf.
//
// One block computes BM = 64 WG query rows of one (batch, head) with WG warpgroups, each
// owning 64 rows: its Q rows, the key tiles K and the value tiles V are read by wgmma straight
// from shared memory (swizzled panels of 64 columns, of 32 at D = 32 and 96: wgmma.cuh); the
// score tile S = Q K^T and the output accumulator live in registers (float32), and the
// probabilities P, rounded to 16 bits in registers, are the A operand of O += P V.  K and V
// tiles of BN keys are double-buffered and copied with cp.async by every thread.  Within a
// warpgroup the products of consecutive tiles overlap the softmax: S of tile j + 1 and
// O += P_j V_j are issued together, the softmax of tile j + 1 runs while the tensor cores
// finish P_j V_j, and O is rescaled after.
#include "wgmma.cuh"
#include "mma.cuh"
#include "exclusion.cuh"

#ifndef SK_LN2
#define SK_LN2 0.6931471805599453f
#define SK_LOG2E 1.4426950408889634f
#endif

// The forward of one block: BM query rows from m0 of one (sequence, head).  qb is the Q row
// m0, kb and vb the first key and value rows, mb the mask's bit rows (or null); row i of the
// output is ob + i o_sl and its lse lb[i l_sl] (lb may be null).  Strides are in elements.
template <typename T, int D, int BN, int WG, bool MASK>
__device__ __forceinline__ void sk_attn_fwd_sm90_body(
    const T* __restrict__ qb, const T* __restrict__ kb, const T* __restrict__ vb,
    const unsigned* __restrict__ mb, T* __restrict__ ob, float* __restrict__ lb,
    long long q_sl, long long k_sl, long long v_sl, long long m_sq, long long o_sl,
    long long l_sl, int m0, int lq, int lk, float scale, float softcap, int offset,
    int causal, int left, int right) {
    constexpr int BM = 64 * WG;
    constexpr int THREADS = 128 * WG;
    constexpr int NS = BN / 2;   // score accumulators per thread
    constexpr int NO = D / 2;    // output accumulators per thread
    constexpr int KS = BN / 16;  // k-slices of P V
    constexpr int DK = D / 16;   // k-slices of Q K^T
    // panels of 64 columns (128-byte rows), or of 32 (64-byte rows) where D is not a multiple
    // of 64 (wgmma.cuh): a warpgroup reads all D columns
    constexpr int PC = sk_panel_cols<D>;
    constexpr int RB = 2 * PC;                                   // bytes of a panel's row
    constexpr int KSP = RB / 32;                                 // k-slices of 16 in a panel
    constexpr unsigned PANEL_Q = BM * RB, PANEL_KV = BN * RB;    // bytes of a panel
    constexpr unsigned STAGE = BN * D * 2;                       // bytes of a K or V tile
    static_assert(D % PC == 0 && BN % 64 == 0, "whole panels");
    typedef SkMma<T> Mma;

    extern __shared__ unsigned char sk_smem_raw[];
    const unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(sk_smem_raw));
    const unsigned aq = (raw + 1023u) & ~1023u;  // the panels' swizzle needs 1024-byte alignment
    T* sq = reinterpret_cast<T*>(sk_smem_raw + (aq - raw));
    T* sk = sq + BM * D;      // 2 stages
    T* sv = sk + 2 * BN * D;  // 2 stages
    const unsigned ak = aq + BM * D * 2, av = ak + 2 * STAGE;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4, wg = threadIdx.x / 128;
    const int w0 = warp * 16;  // this warp's first row in the block

    int n_lo, n_hi;  // keys any row of this block may see
    sk_visible_keys(m0, min(m0 + BM, lq), lk, offset, causal, left, right, n_lo, n_hi);
    const int tile_lo = n_lo / BN;
    const int tile_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : tile_lo;

    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    int rel_lo, rel_hi;
    sk_relative_limits(causal, left, right, rel_lo, rel_hi);

    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.0f;
    float s[NS];
    unsigned p[KS][4];
    float row_max[2] = {-SK_INF, -SK_INF}, row_sum[2] = {0.0f, 0.0f};

    // descriptors of this warpgroup's Q rows and of stage 0 of K and V (K-major Q and K,
    // MN-major V); a k-slice or a stage moves the start address (16-byte units)
    const unsigned long long dv = sk_desc(av, PANEL_KV, 8 * RB, RB);
    const unsigned long long dq = sk_desc(aq + wg * 64 * RB, 16, 8 * RB, RB);
    const unsigned long long dk = sk_desc(ak, 16, 8 * RB, RB);

    // s = Q K^T for the K tile in `stage`
    auto qk = [&](int stage) {
        const unsigned long long kd = dk + stage * (STAGE >> 4);
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const unsigned at = (kk % KSP) * 32;
            SkWgmma<BN>::ss(s, dq + (((kk / KSP) * PANEL_Q + at) >> 4),
                            kd + (((kk / KSP) * PANEL_KV + at) >> 4), kk > 0, T());
        }
    };
    // o += P V for the V tile in `stage`
    auto pv = [&](int stage) {
        const unsigned long long vd = dv + stage * (STAGE >> 4);
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            SkWgmma<D>::rs(o, p[kk], vd + ((kk * 16 * RB) >> 4), 1, T());
        }
    };
    // scores of key tile `tile` in log2 units with exclusions, the new row maxima and sums;
    // s becomes the probabilities, f the factors the older output is rescaled by
    auto softmax = [&](int tile, float (&f)[2]) {
        const int n0 = tile * BN;
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            float x = s[i] * qk_scale;
            if (softcap > 0.0f) x = sk_softcap_log2(x, softcap, inv_cap);
            s[i] = x;
        }
        const int i0 = m0 + w0 + g;  // the thread's first query
        const bool edge = n0 + BN > lk || n0 + BN - 1 - (m0 + w0) - offset > rel_hi ||
                          n0 - (m0 + w0 + 15) - offset < rel_lo || mb != nullptr;
        if (edge) {
            // the mask's 32-key words (exclusion.cuh) of the thread's two rows in this tile:
            // key n0 + 8 nb + 2 t + e is bit 8 (nb % 4) + 2 t + e of word nb / 4
            unsigned words[2][MASK ? BN / 32 : 1];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#pragma unroll
                for (int w = 0; w < (MASK ? BN / 32 : 1); ++w) {
                    const int i = i0 + 8 * r, word = n0 / 32 + w;
                    words[r][w] = MASK && mb != nullptr && i < lq && word * 32 < lk
                                      ? mb[i * m_sq + word] : ~0u;
                }
            }
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = n0 + nb * 8 + 2 * t + (e & 1);
                    const int i = i0 + 8 * (e >> 1);
                    const int rel = j - i - offset;
                    bool out_of = j >= lk || rel > rel_hi || rel < rel_lo;
                    if (MASK) {
                        const unsigned word = words[e >> 1][nb / 4];
                        out_of = out_of || !((word >> (8 * (nb % 4) + 2 * t + (e & 1))) & 1u);
                    }
                    if (out_of) s[4 * nb + e] = -SK_INF;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb)
                mx = fmaxf(mx, fmaxf(s[4 * nb + 2 * r], s[4 * nb + 2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float use = mx == -SK_INF ? 0.0f : mx;  // nothing allowed yet: p = 0
            f[r] = sk_ex2(row_max[r] - use);
            row_max[r] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
                s[4 * nb + 2 * r] = sk_ex2(s[4 * nb + 2 * r] - use);
                s[4 * nb + 2 * r + 1] = sk_ex2(s[4 * nb + 2 * r + 1] - use);
                sum += s[4 * nb + 2 * r] + s[4 * nb + 2 * r + 1];
            }
            row_sum[r] = row_sum[r] * f[r] + sum;
        }
    };
    // P as the A fragments of P V: key slice kk is score blocks 2 kk and 2 kk + 1
    auto pack = [&]() {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            p[kk][0] = Mma::pack(s[8 * kk + 0], s[8 * kk + 1]);
            p[kk][1] = Mma::pack(s[8 * kk + 2], s[8 * kk + 3]);
            p[kk][2] = Mma::pack(s[8 * kk + 4], s[8 * kk + 5]);
            p[kk][3] = Mma::pack(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };
    auto load_k = [&](int tile, int stage) {
        sk_load_panels<T, BN, D, THREADS, PC>(sk + stage * BN * D,
                                          kb + static_cast<long long>(tile) * BN * k_sl, k_sl,
                                          lk - tile * BN);
    };
    auto load_v = [&](int tile, int stage) {
        sk_load_panels<T, BN, D, THREADS, PC>(sv + stage * BN * D,
                                          vb + static_cast<long long>(tile) * BN * v_sl, v_sl,
                                          lk - tile * BN);
    };

    // K tile x and V tile x sit in stage (x - tile_lo) % 2
    if (tile_lo < tile_hi) {
        sk_load_panels<T, BM, D, THREADS, PC>(sq, qb, q_sl, lq - m0);
        load_k(tile_lo, 0);
        sk_cp_async_commit();
        load_v(tile_lo, 0);
        sk_cp_async_commit();
        if (tile_lo + 1 < tile_hi) load_k(tile_lo + 1, 1);
        sk_cp_async_commit();
        sk_cp_async_wait<2>();  // Q and the first K tile
        sk_fence_proxy_async();
        __syncthreads();
        sk_wgmma_fence();
        qk(0);
        sk_wgmma_commit();
        sk_wgmma_wait<0>();
        sk_fence_regs(s);
        float f[2];
        softmax(tile_lo, f);
        pack();
    }
    // every tile but the last: the next scores and this tile's P V in flight together
    for (int tile = tile_lo; tile + 1 < tile_hi; ++tile) {
        const int stage = (tile - tile_lo) & 1;
        // V of this tile and K of the next have landed; every warpgroup is done with the
        // stages the copies below overwrite (K of this tile, V of the previous one)
        sk_cp_async_wait<0>();
        sk_fence_proxy_async();
        __syncthreads();
        if (tile + 2 < tile_hi) load_k(tile + 2, stage);
        sk_cp_async_commit();
        load_v(tile + 1, stage ^ 1);
        sk_cp_async_commit();

        sk_wgmma_fence();
        qk(stage ^ 1);
        sk_wgmma_commit();
        pv(stage);
        sk_wgmma_commit();
        float f[2];
        sk_wgmma_wait<1>();  // the next scores (P V may still run)
        sk_fence_regs(s);
        softmax(tile + 1, f);
        sk_wgmma_wait<0>();
        sk_fence_regs(o);
#pragma unroll
        for (int i = 0; i < NO; ++i) o[i] *= f[(i >> 1) & 1];
        pack();
    }
    if (tile_lo < tile_hi) {  // the last tile's P V
        sk_cp_async_wait<0>();
        sk_fence_proxy_async();
        __syncthreads();
        sk_wgmma_fence();
        pv((tile_hi - 1 - tile_lo) & 1);
        sk_wgmma_commit();
        sk_wgmma_wait<0>();
        sk_fence_regs(o);
    }

    // finish: the quad's partial sums, normalize, store out and lse
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int i = m0 + w0 + g + 8 * r;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        if (i < lq) {
            T* orow = ob + i * o_sl;
#pragma unroll
            for (int db = 0; db < D / 8; ++db) {
                const unsigned packed =
                    Mma::pack(o[4 * db + 2 * r] * inv, o[4 * db + 2 * r + 1] * inv);
                *reinterpret_cast<unsigned*>(orow + db * 8 + 2 * t) = packed;
            }
            if (lb && t == 0) {
                lb[i * l_sl] = l > 0.0f ? (row_max[r] + log2f(l)) * SK_LN2 : -SK_INF;
            }
        }
    }
}

// Dense: q [B, Hq, Lq, D], k and v [B, Hk, Lk, D] by element strides, the mask's bits as
// sk_attn_fwd takes them; out [B, Hq, Lq, D] and lse [B, Hq, Lq] contiguous.  Grid
// (ceil(Lq / BM), Hq, B), the last query blocks (the most keys under causal masks) first.
template <typename T, int D, int BN, int WG, bool MASK>
__global__ void __launch_bounds__(128 * WG, 1) sk_attn_fwd_sm90(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const unsigned* __restrict__ mask, T* __restrict__ out, float* __restrict__ lse,
    long long q_sb, long long q_sh, long long q_sl, long long k_sb, long long k_sh,
    long long k_sl, long long v_sb, long long v_sh, long long v_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    float scale, float softcap, int offset, int causal, int left, int right) {
    const int m0 = (gridDim.x - 1 - blockIdx.x) * 64 * WG;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kh = h / (hq / hk);
    const long long row0 = (static_cast<long long>(b) * hq + h) * lq;
    sk_attn_fwd_sm90_body<T, D, BN, WG, MASK>(
        q + b * q_sb + h * q_sh + static_cast<long long>(m0) * q_sl, k + b * k_sb + kh * k_sh,
        v + b * v_sb + kh * v_sh, MASK && mask ? mask + b * m_sb + h * m_sh : nullptr,
        out + row0 * D, lse ? lse + row0 : nullptr, q_sl, k_sl, v_sl, m_sq, D, 1, m0, lq, lk,
        scale, softcap, offset, causal, left, right);
}

// Packed variable-length sequences (spec "Varlen attention"), the arguments of
// sk_attn_fwd_varlen: q [Tq, Hq, D], k and v [Tk, Hk, D] by token and head strides, sequence
// b the rows cu_q[b] .. cu_q[b + 1] of q (cu_k of k and v); out [Tq, Hq, D] and lse [Tq, Hq]
// contiguous.  Grid (ceil(longest Lq / BM), Hq, B); a block past its sequence's queries exits.
template <typename T, int D, int BN, int WG>
__global__ void __launch_bounds__(128 * WG, 1) sk_attn_fwd_sm90_varlen(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const long long* __restrict__ cu_q, const long long* __restrict__ cu_k,
    T* __restrict__ out, float* __restrict__ lse, long long q_st, long long q_sh,
    long long k_st, long long k_sh, long long v_st, long long v_sh, int hq, int hk,
    float scale, float softcap, int bottom_right, int causal, int left, int right) {
    const int h = blockIdx.y, b = blockIdx.z;
    const long long q0 = cu_q[b], k0 = cu_k[b];
    const int lq = static_cast<int>(cu_q[b + 1] - q0), lk = static_cast<int>(cu_k[b + 1] - k0);
    const int m0 = (gridDim.x - 1 - blockIdx.x) * 64 * WG;
    if (m0 >= lq) return;
    const int kh = h / (hq / hk);
    sk_attn_fwd_sm90_body<T, D, BN, WG, false>(
        q + (q0 + m0) * q_st + h * q_sh, k + k0 * k_st + kh * k_sh, v + k0 * v_st + kh * v_sh,
        nullptr, out + (q0 * hq + h) * D, lse + q0 * hq + h, q_st, k_st, v_st, 0,
        static_cast<long long>(hq) * D, hq, m0, lq, lk, scale, softcap,
        bottom_right ? lk - lq : 0, causal, left, right);
}

// The data path alone, for checking descriptors and fragments on a device: one warpgroup
// computes S = Q K^T (64 x 64, float32) from Q [64 x 128] and K [64 x 128], and O = P V
// (64 x 128) with P = S rounded to T and V [64 x 128]; the V descriptor's two byte offsets
// are arguments (lbo, sbo).
template <typename T>
__global__ void __launch_bounds__(128) sk_wgmma_probe(const T* q, const T* k, const T* v,
                                                      float* s_out, float* o_out, unsigned lbo,
                                                      unsigned sbo) {
    constexpr int D = 128, BN = 64;
    __shared__ __align__(1024) T sq[64 * D];
    __shared__ __align__(1024) T sk[BN * D];
    __shared__ __align__(1024) T sv[BN * D];
    sk_load_panels<T, 64, D, 128>(sq, q, D, 64);
    sk_load_panels<T, BN, D, 128>(sk, k, D, BN);
    sk_load_panels<T, BN, D, 128>(sv, v, D, BN);
    sk_cp_async_commit();
    sk_cp_async_wait<0>();
    sk_fence_proxy_async();
    __syncthreads();
    const unsigned aq = static_cast<unsigned>(__cvta_generic_to_shared(sq));
    const unsigned ak = static_cast<unsigned>(__cvta_generic_to_shared(sk));
    const unsigned av = static_cast<unsigned>(__cvta_generic_to_shared(sv));
    float s[BN / 2];
    sk_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned at = (kk % 4) * 32;
        SkWgmma<BN>::ss(s, sk_desc(aq + (kk / 4) * 64 * 128 + at, 16, 1024),
                        sk_desc(ak + (kk / 4) * BN * 128 + at, 16, 1024), kk > 0, T());
    }
    sk_wgmma_commit();
    sk_wgmma_wait<0>();
    sk_fence_regs(s);
    unsigned p[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        p[kk][0] = SkMma<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = SkMma<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = SkMma<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = SkMma<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
    }
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    sk_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        SkWgmma<D>::rs(o, p[kk], sk_desc(av + kk * 16 * 128, lbo, sbo), 1, T());
    sk_wgmma_commit();
    sk_wgmma_wait<0>();
    sk_fence_regs(o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r = warp * 16 + g;
    for (int nb = 0; nb < BN / 8; ++nb)
        for (int e = 0; e < 4; ++e)
            s_out[(r + (e / 2) * 8) * BN + nb * 8 + 2 * t + (e & 1)] = s[4 * nb + e];
    for (int db = 0; db < D / 8; ++db)
        for (int e = 0; e < 4; ++e)
            o_out[(r + (e / 2) * 8) * D + db * 8 + 2 * t + (e & 1)] = o[4 * db + e];
}
