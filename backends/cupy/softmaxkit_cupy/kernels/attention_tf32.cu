// Attention forward of float32 inputs on tensor cores: mma.sync m16n8k8 with TF32 operands
// and float32 accumulation (spec "Attention", "Precision").
//
// PRECISION = 1 ("tf32"): every operand (q, k, the probabilities P, v) is rounded to TF32
// (cvt.rna: nearest, 10 explicit mantissa bits) and each product is one mma.
// PRECISION = 3 ("tf32x3"): every operand x is split as big = tf32(x), small = tf32(x - big),
// so x - big - small is below 2^-22 |x|, and a b is taken as a_small b_big + a_big b_small +
// a_big b_big (the small products first; a_small b_small, below 2^-22 |a b|, is left out):
// three mma per product, about float32's accuracy.
//
// The order of work is kernels/attention.cu's (FlashAttention-2): one block computes
// BM = 16 * MT * WARPS query rows of one (batch, head), each warp 16 MT rows, with the scores
// S = Q K^T and the output accumulator in registers and K, V tiles of BN keys double-buffered
// in shared memory by cp.async.  The float32 tiles sit in shared memory as rows of 2 D 16-bit
// units under kernels/mma.cuh's swizzle, so ldmatrix reads the A fragments of Q and the B
// fragments of K (an 8 x 8 matrix of 16-bit units is 8 rows of 4 floats: lane (g, t) gets
// row g, float t, which is the m16n8k8 TF32 A and B layout).  Fragments are split in
// registers as they are read (Q's too: a second Q tile of small parts would cost the shared
// memory that lets two blocks share a multiprocessor).  P feeds P V without leaving registers: the C fragment of a score
// tile gives lane (g, t) keys 2t and 2t + 1 of each 8, and the A fragment of m16n8k8 wants
// k-indices t and t + 4, so k-index t stands for key 2t and t + 4 for key 2t + 1 (the keys are
// summed over, so their order is free) and V's B fragment is read in that order: lane (g, t)
// loads v[2t][g] and v[2t + 1][g] of each 8 x 8 block (conflict-free under the swizzle).
#include "mma.cuh"
#include "exclusion.cuh"

#define SK_LN2 0.6931471805599453f
#define SK_LOG2E 1.4426950408889634f

// x rounded to TF32 (nearest, ties away from zero), as the bits an mma operand takes.
__device__ __forceinline__ unsigned sk_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// x as big + small TF32 parts (small is left unused, and unmade, with one product).
__device__ __forceinline__ void sk_tf32_split(float x, unsigned& big, unsigned& small) {
    big = sk_tf32(x);
    small = sk_tf32(x - __uint_as_float(big));
}

__device__ __forceinline__ void sk_mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                            unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b in PRECISION products of the split operands (a = ab + as, b = (bb0, bb1) +
// (bs0, bs1)); the small products go first, while c is still small beside them.
template <int PRECISION>
__device__ __forceinline__ void sk_mma_split(float (&c)[4], const unsigned (&ab)[4],
                                             const unsigned (&as)[4], unsigned bb0, unsigned bb1,
                                             unsigned bs0, unsigned bs1) {
    if constexpr (PRECISION == 3) {
        sk_mma_tf32(c, as, bb0, bb1);
        sk_mma_tf32(c, ab, bs0, bs1);
    }
    sk_mma_tf32(c, ab, bb0, bb1);
}

// The four registers of a fragment read as floats, split.
__device__ __forceinline__ void sk_split4(const unsigned (&raw)[4], unsigned (&big)[4],
                                          unsigned (&small)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sk_tf32_split(__uint_as_float(raw[i]), big[i], small[i]);
}

// Forward: q [B, Hq, Lq, D], k, v [B, Hk, Lk, D] float32 by element strides (16-byte aligned
// rows), out [B, Hq, Lq, D] and lse [B, Hq, Lq] contiguous; the parameters are sk_attn_fwd's.
// At least one block a multiprocessor: ptxas may then take the registers the split operands
// need (it otherwise held some builds to 168 and spilled); two blocks of four warps still fit.
template <int D, int WARPS, int BN, int MT, bool MASK, int PRECISION>
__global__ void __launch_bounds__(WARPS * 32, 1) sk_attn_fwd_tf32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const unsigned* __restrict__ mask, float* __restrict__ out, float* __restrict__ lse,
    long long q_sb, long long q_sh, long long q_sl, long long k_sb, long long k_sh,
    long long k_sl, long long v_sb, long long v_sh, long long v_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    float scale, float softcap, int offset, int causal, int left, int right) {
    static_assert(PRECISION == 1 || PRECISION == 3, "one product (tf32) or three (tf32x3)");
    typedef unsigned short u16;  // the tiles' unit for the swizzle, cp.async and ldmatrix
    constexpr int W = 2 * D;     // a float row in 16-bit units
    constexpr int BM = 16 * MT * WARPS;
    constexpr int THREADS = WARPS * 32;
    constexpr int NB = BN / 8;   // n-blocks of the score tile
    constexpr int DB = D / 8;    // n-blocks of the output
    constexpr int DK = D / 8;    // k-slices of the head dimension
    extern __shared__ __align__(16) unsigned char sk_smem[];
    u16* sq = reinterpret_cast<u16*>(sk_smem);
    u16* sk = sq + BM * W;      // 2 stages
    u16* sv = sk + 2 * BN * W;  // 2 stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the most keys under causal first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kh = h / (hq / hk);
    // as 16-bit units: element strides double
    const u16* qb = reinterpret_cast<const u16*>(q + b * q_sb + h * q_sh +
                                                 static_cast<long long>(m0) * q_sl);
    const u16* kb = reinterpret_cast<const u16*>(k + b * k_sb + kh * k_sh);
    const u16* vb = reinterpret_cast<const u16*>(v + b * v_sb + kh * v_sh);
    const long long ql = 2 * q_sl, kl = 2 * k_sl, vl = 2 * v_sl;
    const unsigned* mb = MASK && mask ? mask + b * m_sb + h * m_sh : nullptr;

    // keys any row of this block may see
    int n_lo = 0, n_hi = lk;
    {
        const int last = min(m0 + BM, lq) - 1 + offset;
        if (causal) n_hi = min(n_hi, last + 1);
        if (right >= 0) n_hi = min(n_hi, last + right + 1);
        if (left >= 0) n_lo = max(0, m0 + offset - left);
    }
    const int tile_lo = n_lo / BN;
    const int tile_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : tile_lo;

    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    int rel_lo, rel_hi;
    sk_relative_limits(causal, left, right, rel_lo, rel_hi);
    float o[MT][DB][4];
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DB; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
        row_max[mt][0] = row_max[mt][1] = -SK_INF;
        row_sum[mt][0] = row_sum[mt][1] = 0.0f;
    }

    if (tile_lo < tile_hi) {
        sk_load_tile<u16, BM, W, THREADS>(sq, qb, ql, lq - m0);
        sk_load_tile<u16, BN, W, THREADS>(sk, kb + tile_lo * BN * kl, kl, lk - tile_lo * BN);
        sk_cp_async_commit();
        sk_load_tile<u16, BN, W, THREADS>(sv, vb + tile_lo * BN * vl, vl, lk - tile_lo * BN);
        sk_cp_async_commit();
    }
    const int w0 = warp * 16 * MT;  // this warp's first row in the block

    for (int tile = tile_lo; tile < tile_hi; ++tile) {
        const int stage = (tile - tile_lo) & 1;
        const int n0 = tile * BN;
        sk_cp_async_wait<1>();  // this tile's K (and, the first time, Q) has landed
        __syncthreads();
        if (tile + 1 < tile_hi) {
            sk_load_tile<u16, BN, W, THREADS>(sk + (stage ^ 1) * BN * W, kb + (n0 + BN) * kl,
                                              kl, lk - n0 - BN);
        }
        sk_cp_async_commit();

        float s[MT][NB][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NB; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
        const u16* ks = sk + stage * BN * W;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            unsigned qa[MT][4], qs[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                unsigned raw[4];
                sk_frag<SK_A, W>(raw, sq, w0 + 16 * mt, kk * 8 * 2);
                sk_split4(raw, qa[mt], qs[mt]);
            }
#pragma unroll
            for (int nb = 0; nb < NB; nb += 2) {
                unsigned raw[4], kbig[4], ksmall[4];
                sk_frag<SK_B, W>(raw, ks, nb * 8, kk * 8 * 2);
                sk_split4(raw, kbig, ksmall);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    sk_mma_split<PRECISION>(s[mt][nb], qa[mt], qs[mt], kbig[0], kbig[1],
                                            ksmall[0], ksmall[1]);
                    sk_mma_split<PRECISION>(s[mt][nb + 1], qa[mt], qs[mt], kbig[2], kbig[3],
                                            ksmall[2], ksmall[3]);
                }
            }
        }

        // scores in log2 units, exclusions as -inf
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[mt][nb][e] * qk_scale;
                    if (softcap > 0.0f) x = sk_softcap_log2(x, softcap, inv_cap);
                    s[mt][nb][e] = x;
                }
            }
        }
        const bool edge = n0 + BN > lk || n0 + BN - 1 > m0 + offset + rel_hi ||
                          n0 < m0 + BM - 1 + offset + rel_lo || mb != nullptr;
        if (edge) sk_exclude<MT, NB>(s, n0 + 2 * t, lk, n0 + 2 * t - (m0 + w0 + g) - offset,
                                     rel_lo, rel_hi, mb, m0 + w0 + g, lq, m_sq);

        // online softmax: new maxima (over the quad that shares each row), rescale, exponentiate
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float scale_old[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = row_max[mt][r];
#pragma unroll
                for (int nb = 0; nb < NB; ++nb)
                    mx = fmaxf(mx, fmaxf(s[mt][nb][2 * r], s[mt][nb][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float use = mx == -SK_INF ? 0.0f : mx;  // nothing allowed yet: p = 0
                scale_old[r] = sk_ex2(row_max[mt][r] - use);
                row_max[mt][r] = mx;
                float sum = 0.0f;
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    s[mt][nb][2 * r] = sk_ex2(s[mt][nb][2 * r] - use);
                    s[mt][nb][2 * r + 1] = sk_ex2(s[mt][nb][2 * r + 1] - use);
                    sum += s[mt][nb][2 * r] + s[mt][nb][2 * r + 1];
                }
                row_sum[mt][r] = row_sum[mt][r] * scale_old[r] + sum;
            }
#pragma unroll
            for (int i = 0; i < DB; ++i) sk_scale_rows(o[mt][i], scale_old);
        }

        sk_cp_async_wait<1>();  // this tile's V has landed
        __syncthreads();
        if (tile + 1 < tile_hi) {
            sk_load_tile<u16, BN, W, THREADS>(sv + (stage ^ 1) * BN * W, vb + (n0 + BN) * vl,
                                              vl, lk - n0 - BN);
        }
        sk_cp_async_commit();

        const float* vs = reinterpret_cast<const float*>(sv + stage * BN * W);
#pragma unroll
        for (int kk = 0; kk < NB; ++kk) {  // 8 keys a step: k-index t is key 2t, t + 4 is 2t + 1
            unsigned pa[MT][4], ps[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float (&c)[4] = s[mt][kk];
                sk_tf32_split(c[0], pa[mt][0], ps[mt][0]);  // (g, key 2t)
                sk_tf32_split(c[2], pa[mt][1], ps[mt][1]);  // (g + 8, key 2t)
                sk_tf32_split(c[1], pa[mt][2], ps[mt][2]);  // (g, key 2t + 1)
                sk_tf32_split(c[3], pa[mt][3], ps[mt][3]);  // (g + 8, key 2t + 1)
            }
            const int r0 = kk * 8 + 2 * t;
#pragma unroll
            for (int db = 0; db < DB; ++db) {
                const int c = 2 * (db * 8 + g);  // the value column, in 16-bit units
                unsigned vb0, vb1, vs0, vs1;
                sk_tf32_split(vs[sk_swz<W>(r0, c) / 2], vb0, vs0);
                sk_tf32_split(vs[sk_swz<W>(r0 + 1, c) / 2], vb1, vs1);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    sk_mma_split<PRECISION>(o[mt][db], pa[mt], ps[mt], vb0, vb1, vs0, vs1);
                }
            }
        }
    }
    sk_cp_async_wait<0>();

    // finish: the quad's partial sums, normalize, store out and lse
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = row_sum[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int i = m0 + w0 + 16 * mt + g + 8 * r;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            if (i < lq) {
                const long long row = (static_cast<long long>(b) * hq + h) * lq + i;
                float* orow = out + row * D;
#pragma unroll
                for (int db = 0; db < DB; ++db) {
                    *reinterpret_cast<float2*>(orow + db * 8 + 2 * t) =
                        make_float2(o[mt][db][2 * r] * inv, o[mt][db][2 * r + 1] * inv);
                }
                if (lse && t == 0) {
                    lse[row] = l > 0.0f ? (row_max[mt][r] + log2f(l)) * SK_LN2 : -SK_INF;
                }
            }
        }
    }
}
