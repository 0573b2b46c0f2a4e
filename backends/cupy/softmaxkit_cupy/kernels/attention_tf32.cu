// Attention forward of float32 inputs on tensor cores: mma.sync m16n8k8 with TF32 operands
// and float32 accumulation (spec "Attention", "Precision").
//
// PRECISION = 1 ("tf32"): every operand (q, k, the probabilities P, v) is rounded to TF32
// (cvt.rna: nearest, 10 explicit mantissa bits) and each product is one mma.
// PRECISION = 3 ("tf32x3"): every operand x is split as big = tf32(x), small = tf32(x - big),
// so x - big - small is below 2^-22 |x|, and a b is taken as a_small b_big + a_big b_small +
// a_big b_big (the small products first; a_small b_small, below 2^-22 |a b|, is left out):
// three mma per product, about float32's accuracy.  The tensor cores truncate their float32
// sums (round toward zero), so with STAGE (tf32x3 only) each key tile's P V goes to a zeroed
// accumulator of its own and is added to the output's in float32 after the tile, as CUTLASS's
// 3xTF32 main loops stage theirs: in place, every k-step's three products would be truncated
// against the whole output's magnitude, and those errors, all of one sign, add up over the keys.
//
// The order of work is kernels/attention.cu's (FlashAttention-2): one block computes
// BM = 16 * MT * WARPS query rows of one (batch, head), each warp 16 MT rows, with the scores
// S = Q K^T and the output accumulator in registers and K, V tiles of BN keys double-buffered
// in shared memory by cp.async.  At three products (tf32x3) the float32 tiles sit in shared
// memory as rows of 2 D 16-bit units under kernels/mma.cuh's swizzle, so ldmatrix reads the
// A fragments of Q and the B fragments of K (an 8 x 8 matrix of 16-bit units is 8 rows of 4
// floats: lane (g, t) gets row g, float t, which is the m16n8k8 TF32 A and B layout), and
// fragments are split in registers as they are read (Q's too: a second Q tile of small parts
// would cost the shared memory that lets two blocks share a multiprocessor); at one product
// the operands are rounded once a block (ROUNDED, at the kernel).  P feeds P V without
// leaving registers: the C fragment of a score tile gives lane (g, t) keys 2t and 2t + 1 of
// each 8, and the A fragment of m16n8k8 wants k-indices t and t + 4, so k-index t stands for
// key 2t and t + 4 for key 2t + 1 (the keys are summed over, so their order is free) and V's
// B fragment is read in that order: lane (g, t) loads v[2t][g] and v[2t + 1][g] of each
// 8 x 8 block (conflict-free under the swizzle).
#include "mma.cuh"
#include "exclusion.cuh"
#include "bwd_pre.cuh"

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

// x's four floats rounded to TF32.
__device__ __forceinline__ float4 sk_tf32_4(float4 x) {
    return make_float4(__uint_as_float(sk_tf32(x.x)), __uint_as_float(sk_tf32(x.y)),
                       __uint_as_float(sk_tf32(x.z)), __uint_as_float(sk_tf32(x.w)));
}

// The floats of rows [0, ROWS) of a shared tile of row width PW, columns [0, D), rounded to
// TF32 in place; the float4 chunks shared among THREADS threads.
template <int ROWS, int D, int PW, int THREADS>
__device__ __forceinline__ void sk_round_rows(float* tile) {
    constexpr int CHUNKS = ROWS * D / 4;
    static_assert(CHUNKS % THREADS == 0, "as many chunks a thread");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
        const int c = threadIdx.x + i * THREADS;
        float4* at = reinterpret_cast<float4*>(tile + (c / (D / 4)) * PW + 4 * (c % (D / 4)));
        *at = sk_tf32_4(*at);
    }
}

// dst [D x TP] = src [ROWS x SP] (columns [0, D)) transposed and rounded to TF32.  Consecutive
// threads take consecutive rows of one float4 column chunk: their float4 reads start 4 banks
// apart (SP = 4 mod 32) and their scalar writes fall in consecutive banks.
template <int ROWS, int D, int SP, int TP, int THREADS>
__device__ __forceinline__ void sk_round_transposed(float* dst, const float* src) {
    constexpr int CHUNKS = ROWS * D / 4;
    static_assert(CHUNKS % THREADS == 0, "as many chunks a thread");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
        const int c = threadIdx.x + i * THREADS;
        const int r = c % ROWS, col = 4 * (c / ROWS);
        const float4 x = sk_tf32_4(*reinterpret_cast<const float4*>(src + r * SP + col));
        dst[(col + 0) * TP + r] = x.x;
        dst[(col + 1) * TP + r] = x.y;
        dst[(col + 2) * TP + r] = x.z;
        dst[(col + 3) * TP + r] = x.w;
    }
}

// Forward: q [B, Hq, Lq, D], k, v [B, Hk, Lk, D] float32 by element strides (16-byte aligned
// rows), out [B, Hq, Lq, D] and lse [B, Hq, Lq] contiguous; the parameters are sk_attn_fwd's.
//
// At one product (ROUNDED) every operand is rounded to TF32 once a block, where the split
// path rounds Q, K and V in every warp and for every tile (cvt.rna.tf32 is three instructions
// on sm_80 and sm_90): a warp's Q fragments are rounded into registers at the first tile and
// held there; each K tile is rounded in place and each V tile rounded into V^T, over Q's
// rows, by the whole block as it lands.  The tiles are then unswizzled rows of padded floats
// and every fragment one 64-bit read at a lane's base plus a constant: the product over the
// head dimension takes k-index t as column 2t and t + 4 as 2t + 1 of each eight (Q's and
// K's, so the sum is the same), so lane (g, t) reads Q[g][2t, 2t + 1] and K[g][2t, 2t + 1],
// and P V reads V^T[g][2t, 2t + 1], the keys 2t and 2t + 1 that P's fragment stands for.
// Rows of D + 8 floats (Q, K) and BN + 8 (V^T) put the sixteen lanes of a 64-bit read in
// distinct banks.  V lands in one stage of rows of D + 4 floats: its next tile is copied once
// the block has transposed this one, and the layout fits in the split path's shared memory.
//
// At least one block a multiprocessor: ptxas may then take the registers the split operands
// need (it otherwise held some builds to 168 and spilled); two blocks of four warps still fit.
template <int D, int WARPS, int BN, int MT, bool MASK, int PRECISION, bool STAGE>
__global__ void __launch_bounds__(WARPS * 32, 1) sk_attn_fwd_tf32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const unsigned* __restrict__ mask, float* __restrict__ out, float* __restrict__ lse,
    long long q_sb, long long q_sh, long long q_sl, long long k_sb, long long k_sh,
    long long k_sl, long long v_sb, long long v_sh, long long v_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    float scale, float softcap, int offset, int causal, int left, int right) {
    static_assert(PRECISION == 1 || PRECISION == 3, "one product (tf32) or three (tf32x3)");
    static_assert(!STAGE || PRECISION == 3, "staged sums are for the three-product precision");
    constexpr bool ROUNDED = PRECISION == 1;
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
    constexpr int QP = D + 8, VP = D + 4, TP = BN + 8;  // ROUNDED: row widths in floats
    static_assert(!ROUNDED || ((BM + 2 * BN) * QP + BN * VP <= (BM + 4 * BN) * D &&
                               D * TP <= BM * QP), "the rounded layout in the split one's bytes");
    float* fq = reinterpret_cast<float*>(sk_smem);  // ROUNDED: Q, then V^T [D x TP]
    float* fk = fq + BM * QP;                        // 2 stages
    float* fv = fk + 2 * BN * QP;                    // 1 stage

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    int m0, h, b;
    sk_row_block(causal, BM, m0, h, b);
    const int kh = h / (hq / hk);
    const float* qf = q + b * q_sb + h * q_sh + static_cast<long long>(m0) * q_sl;
    const float* kf = k + b * k_sb + kh * k_sh;
    const float* vf = v + b * v_sb + kh * v_sh;
    // as 16-bit units: element strides double
    const u16* qb = reinterpret_cast<const u16*>(qf);
    const u16* kb = reinterpret_cast<const u16*>(kf);
    const u16* vb = reinterpret_cast<const u16*>(vf);
    const long long ql = 2 * q_sl, kl = 2 * k_sl, vl = 2 * v_sl;
    const unsigned* mb = MASK && mask ? mask + b * m_sb + h * m_sh : nullptr;

    int n_lo, n_hi;  // keys any row of this block may see
    sk_visible_keys(m0, min(m0 + BM, lq), lk, offset, causal, left, right, n_lo, n_hi);
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
        if constexpr (ROUNDED) {
            const long long n = static_cast<long long>(tile_lo) * BN;
            sk_load_padded<BM, D, THREADS, QP>(fq, qf, q_sl, lq - m0);
            sk_load_padded<BN, D, THREADS, QP>(fk, kf + n * k_sl, k_sl, lk - tile_lo * BN);
            sk_load_padded<BN, D, THREADS, VP>(fv, vf + n * v_sl, v_sl, lk - tile_lo * BN);
        } else {
            sk_load_tile<u16, BM, W, THREADS>(sq, qb, ql, lq - m0);
            sk_load_tile<u16, BN, W, THREADS>(sk, kb + tile_lo * BN * kl, kl, lk - tile_lo * BN);
            sk_cp_async_commit();
            sk_load_tile<u16, BN, W, THREADS>(sv, vb + tile_lo * BN * vl, vl, lk - tile_lo * BN);
        }
        sk_cp_async_commit();
    }
    const int w0 = warp * 16 * MT;  // this warp's first row in the block
    unsigned qr[ROUNDED ? MT : 1][ROUNDED ? DK : 1][4];  // ROUNDED: Q's fragments, as TF32

    for (int tile = tile_lo; tile < tile_hi; ++tile) {
        const int stage = (tile - tile_lo) & 1;
        const int n0 = tile * BN;
        if constexpr (ROUNDED) {
            sk_cp_async_wait<0>();  // this tile's K and V (and, the first time, Q) have landed
            __syncthreads();        // for every thread, and the last tile's reads are done
            if (tile == tile_lo) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                    for (int kk = 0; kk < DK; ++kk) {
                        const float* at = fq + (w0 + 16 * mt + g) * QP + kk * 8 + 2 * t;
                        const float2 lo = *reinterpret_cast<const float2*>(at);
                        const float2 hi = *reinterpret_cast<const float2*>(at + 8 * QP);
                        qr[mt][kk][0] = sk_tf32(lo.x);  // (g, column 2t): k-index t
                        qr[mt][kk][1] = sk_tf32(hi.x);  // (g + 8, 2t)
                        qr[mt][kk][2] = sk_tf32(lo.y);  // (g, 2t + 1): k-index t + 4
                        qr[mt][kk][3] = sk_tf32(hi.y);  // (g + 8, 2t + 1)
                    }
                }
                __syncthreads();  // every warp holds its Q: V^T may take Q's rows
            }
            if (tile + 1 < tile_hi) {
                sk_load_padded<BN, D, THREADS, QP>(fk + (stage ^ 1) * BN * QP,
                                                   kf + (n0 + BN) * k_sl, k_sl, lk - n0 - BN);
            }
            sk_cp_async_commit();
            sk_round_rows<BN, D, QP, THREADS>(fk + stage * BN * QP);
            sk_round_transposed<BN, D, VP, TP, THREADS>(fq, fv);
            __syncthreads();  // K and V^T are TF32, and V's stage is free
            if (tile + 1 < tile_hi) {
                sk_load_padded<BN, D, THREADS, VP>(fv, vf + (n0 + BN) * v_sl, v_sl,
                                                   lk - n0 - BN);
            }
            sk_cp_async_commit();
        } else {
            sk_cp_async_wait<1>();  // this tile's K (and, the first time, Q) has landed
            __syncthreads();
            if (tile + 1 < tile_hi) {
                sk_load_tile<u16, BN, W, THREADS>(sk + (stage ^ 1) * BN * W,
                                                  kb + (n0 + BN) * kl, kl, lk - n0 - BN);
            }
            sk_cp_async_commit();
        }

        float s[MT][NB][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NB; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
        const u16* ks = sk + stage * BN * W;
        const float* kt = fk + stage * BN * QP;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            if constexpr (ROUNDED) {
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    const float2 kr =
                        *reinterpret_cast<const float2*>(kt + (nb * 8 + g) * QP + kk * 8 + 2 * t);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        sk_mma_tf32(s[mt][nb], qr[mt][kk], __float_as_uint(kr.x),
                                    __float_as_uint(kr.y));
                }
                continue;
            }
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

        if constexpr (!ROUNDED) {
            sk_cp_async_wait<1>();  // this tile's V has landed
            __syncthreads();
            if (tile + 1 < tile_hi) {
                sk_load_tile<u16, BN, W, THREADS>(sv + (stage ^ 1) * BN * W,
                                                  vb + (n0 + BN) * vl, vl, lk - n0 - BN);
            }
            sk_cp_async_commit();
        }

        const float* vs = reinterpret_cast<const float*>(sv + stage * BN * W);
        float pv[MT][DB][4] = {};  // this tile's P V, from zero (STAGE; unused otherwise)
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
                unsigned vb0, vb1, vs0 = 0u, vs1 = 0u;
                if constexpr (ROUNDED) {  // V^T[column][keys 2t, 2t + 1], already TF32
                    const float2 vr =
                        *reinterpret_cast<const float2*>(fq + (db * 8 + g) * TP + r0);
                    vb0 = __float_as_uint(vr.x);
                    vb1 = __float_as_uint(vr.y);
                } else {
                    sk_tf32_split(vs[sk_swz<W>(r0, c) / 2], vb0, vs0);
                    sk_tf32_split(vs[sk_swz<W>(r0 + 1, c) / 2], vb1, vs1);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    sk_mma_split<PRECISION>(STAGE ? pv[mt][db] : o[mt][db], pa[mt], ps[mt], vb0,
                                            vb1, vs0, vs1);
                }
            }
        }
        if constexpr (STAGE) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int db = 0; db < DB; ++db)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[mt][db][e] += pv[mt][db][e];
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

// --- backward -------------------------------------------------------------------------------
//
// The gradient of attention (spec "Gradients") with its five products on TF32 tensor cores at
// PRECISION, in kernels/attention_bwd.cu's order: block (key tile, key head, batch) holds
// BN = 16 * WARPS keys' K and V in shared memory while the query tiles of every query head
// of the group stream through two stages; warp w owns keys [16 w, 16 w + 16) and accumulates
// their dK and dV in registers; dS^T goes through shared memory (float32) for dQ's partial
// product, added into a float32 buffer.  The adapter gives lse2 = lse log2 e (+inf for a row
// with no allowed key and for padding rows, so their P is 0) and delta = rowsum(dO O) - dlse,
// both [B * Hq, lq_pad], and scales dQ's buffer.
//
// Products whose contraction runs over a tile's queries (dV = P^T dO, dK = dS^T Q) take P^T
// and dS^T from registers as the forward takes P (k-index t is query 2t, t + 4 is 2t + 1) and
// read dO and Q in that order; dQ = dS K contracts over keys in the same order, reading dS^T
// and K from shared memory.

// The backward's float tiles in shared memory are rows of D + 4 floats, unswizzled: the 16
// extra bytes a row put the 8 rows an ldmatrix reads, and the rows 2t, 2t + 1 and columns
// g that a warp's scalar reads take, in distinct banks, and every address is a lane's base
// plus a constant.
// (sk_load_padded, kernels/mma.cuh, copies them.)

// The SK_A or SK_B fragment of an m16n8k8 TF32 product (as sk_frag's) from a padded tile of
// width D: rows r0.., floats c0..c0 + 7.
template <SkFrag F, int D>
__device__ __forceinline__ void sk_frag_padded(unsigned (&f)[4], const float* tile, int r0,
                                               int c0) {
    constexpr bool down = F == SK_A;
    const int lane = threadIdx.x & 31;
    const int lo = (lane >> 3) & 1, hi = lane >> 4;
    const int r = r0 + (lane & 7) + (down ? lo : hi) * 8;
    const int c = c0 + (down ? hi : lo) * 4;
    sk_ldmatrix_x4(f, tile + r * (D + 4) + c);
}

// c[nb] += A B^T over D at PRECISION: A the warp's 16 rows of padded tile a from row a0, B
// the NB n-blocks of padded tile b; fragments split as they are read.
template <int PRECISION, int D, int NB>
__device__ __forceinline__ void sk_tf32_abt(float (&c)[NB][4], const float* a, int a0,
                                            const float* b) {
#pragma unroll
    for (int kk = 0; kk < D / 8; ++kk) {
        unsigned raw[4], ab[4], as[4];
        sk_frag_padded<SK_A, D>(raw, a, a0, kk * 8);
        sk_split4(raw, ab, as);
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            unsigned bb[4], bs[4];
            sk_frag_padded<SK_B, D>(raw, b, nb * 8, kk * 8);
            sk_split4(raw, bb, bs);
            sk_mma_split<PRECISION>(c[nb], ab, as, bb[0], bb[1], bs[0], bs[1]);
            sk_mma_split<PRECISION>(c[nb + 1], ab, as, bb[2], bb[3], bs[2], bs[3]);
        }
    }
}

// The A fragment of an m16n8k8 product whose k-slice is the n-block c of a C accumulator
// (k-index t standing for column 2t, t + 4 for 2t + 1), split.
__device__ __forceinline__ void sk_tf32_a_of_c(const float (&c)[4], unsigned (&big)[4],
                                               unsigned (&small)[4]) {
    sk_tf32_split(c[0], big[0], small[0]);  // (g, 2t)
    sk_tf32_split(c[2], big[1], small[1]);  // (g + 8, 2t)
    sk_tf32_split(c[1], big[2], small[2]);  // (g, 2t + 1)
    sk_tf32_split(c[3], big[3], small[3]);  // (g + 8, 2t + 1)
}

// Shared memory (padded rows): K, V [BN x D]; Q, dO [2][BM x D]; dS^T [BN x BM]; lse2, delta
// [2][BM].
// q, dO [B, Hq, Lq, D] and k, v [B, Hk, Lk, D] float32 by element strides (16-byte aligned
// rows); lse2, delta [B * Hq, lq_pad], dq_acc [B * Hq, lq_pad, D] (zeroed); dk, dv
// [B, Hk, Lk, D] contiguous.
template <int D, int WARPS, int BM, bool MASK, int PRECISION>
__global__ void __launch_bounds__(WARPS * 32, 1) sk_attn_bwd_tf32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ dout, const unsigned* __restrict__ mask,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    float* __restrict__ dk, float* __restrict__ dv, long long q_sb, long long q_sh,
    long long q_sl, long long k_sb, long long k_sh, long long k_sl, long long v_sb,
    long long v_sh, long long v_sl, long long g_sb, long long g_sh, long long g_sl,
    long long m_sb, long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    int lq_pad, float scale, float softcap, int offset, int causal, int left, int right) {
    static_assert(PRECISION == 1 || PRECISION == 3, "one product (tf32) or three (tf32x3)");
    constexpr int LD = D + 4, LS = BM + 4;  // row strides of Q, K, V, dO and of dS^T
    constexpr int BN = 16 * WARPS;
    constexpr int THREADS = WARPS * 32;
    constexpr int NB = BM / 8;  // n-blocks of S^T (query columns)
    constexpr int DB = D / 8;   // n-blocks of dK, dV
    // dQ's [BM x D] partial product: WM x WN warps, each 16 rows x D / WN columns, in passes
    // of at most 64 columns
    constexpr int WM = BM / 16;
    constexpr int WN = WARPS / WM;
    constexpr int QCOLS = D / WN;
    constexpr int PCOLS = QCOLS <= 64 ? QCOLS : (QCOLS % 64 == 0 ? 64 : 48);
    static_assert(WARPS % WM == 0 && QCOLS % PCOLS == 0 && PCOLS % 16 == 0, "dQ warp layout");
    extern __shared__ __align__(16) unsigned char sk_smem[];
    float* sk = reinterpret_cast<float*>(sk_smem);
    float* sv = sk + BN * LD;
    float* sq = sv + BN * LD;     // 2 stages
    float* sg = sq + 2 * BM * LD;  // dO, 2 stages
    float* sds = sg + 2 * BM * LD;  // dS^T
    float* sl = sds + BN * LS;     // lse2, 2 stages
    float* sd = sl + 2 * BM;       // delta, 2 stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * BN, kh = blockIdx.y, b = blockIdx.z;
    const int group = hq / hk;
    const float* kb = k + b * k_sb + kh * k_sh + static_cast<long long>(n0) * k_sl;
    const float* vb = v + b * v_sb + kh * v_sh + static_cast<long long>(n0) * v_sl;

    int m_lo, m_hi;  // query rows any key of this tile may be seen by
    sk_seeing_queries(n0, min(n0 + BN, lk), lq, offset, causal, left, right, m_lo, m_hi);
    const int t_lo = m_lo / BM;
    const int tiles = m_hi > m_lo ? (m_hi + BM - 1) / BM - t_lo : 0;
    const int total = group * tiles;

    auto load_stage = [&](int it, int st) {
        const int h = kh * group + it / tiles;
        const int m0 = (t_lo + it % tiles) * BM;
        const long long qo = b * q_sb + h * q_sh + static_cast<long long>(m0) * q_sl;
        const long long go = b * g_sb + h * g_sh + static_cast<long long>(m0) * g_sl;
        sk_load_padded<BM, D, THREADS>(sq + st * BM * LD, q + qo, q_sl, lq - m0);
        sk_load_padded<BM, D, THREADS>(sg + st * BM * LD, dout + go, g_sl, lq - m0);
        const long long ro = (static_cast<long long>(b) * hq + h) * lq_pad + m0;
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
    const int w0 = warp * 16;  // this warp's first key in the tile

    if (total > 0) {
        sk_load_padded<BN, D, THREADS>(sk, kb, k_sl, lk - n0);
        sk_load_padded<BN, D, THREADS>(sv, vb, v_sl, lk - n0);
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
        const float* sqs = sq + st * BM * LD;
        const float* sgs = sg + st * BM * LD;

        // dP^T = V_w dO^T and S^T = K_w Q^T: 16 keys x BM queries per warp
        float dp[NB][4], s[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] = 0.0f;
        }
        sk_tf32_abt<PRECISION, D, NB>(dp, sv, w0, sgs);
        sk_tf32_abt<PRECISION, D, NB>(s, sk, w0, sqs);

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
        const unsigned* mh = MASK && mask ? mask + b * m_sb + h * m_sh : nullptr;
        const bool edge = n0 + BN > lk || n0 + BN - 1 > m0 + offset + rel_hi ||
                          n0 < m0 + BM - 1 + offset + rel_lo || mh != nullptr;
        if (edge) {
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

        // dV_w += P^T dO and dK_w += dS^T Q (k = 8 of the tile's queries a step)
#pragma unroll
        for (int kk = 0; kk < NB; ++kk) {
            unsigned pb[4], ps[4], db_[4], ds_[4];
            sk_tf32_a_of_c(s[kk], pb, ps);
            sk_tf32_a_of_c(dp[kk], db_, ds_);
            const int r0 = kk * 8 + 2 * t;
            const float* gr = sgs + r0 * LD + g;  // dO and Q at (r0, g): + LD a row, + 8 a block
            const float* qr = sqs + r0 * LD + g;
#pragma unroll
            for (int db = 0; db < DB; ++db) {
                unsigned b0, b1, s0, s1;
                sk_tf32_split(gr[db * 8], b0, s0);
                sk_tf32_split(gr[LD + db * 8], b1, s1);
                sk_mma_split<PRECISION>(dv_acc[db], pb, ps, b0, b1, s0, s1);
                sk_tf32_split(qr[db * 8], b0, s0);
                sk_tf32_split(qr[LD + db * 8], b1, s1);
                sk_mma_split<PRECISION>(dk_acc[db], db_, ds_, b0, b1, s0, s1);
            }
            // dS^T to shared memory ([key][query], float32) for dQ
            *reinterpret_cast<float2*>(sds + (w0 + g) * LS + r0) =
                make_float2(dp[kk][0], dp[kk][1]);
            *reinterpret_cast<float2*>(sds + (w0 + g + 8) * LS + r0) =
                make_float2(dp[kk][2], dp[kk][3]);
        }
        __syncthreads();

        // dQ[BM x D] += dS K (unscaled), added into the float32 buffer; k = 8 keys a step,
        // k-index t standing for key 2t and t + 4 for 2t + 1
        {
            const int wm = warp % WM, wn = warp / WM;
            float* qrow = dq_acc + ((static_cast<long long>(b) * hq + h) * lq_pad + m0 +
                                    wm * 16 + g) * D;
#pragma unroll
            for (int pass = 0; pass < QCOLS / PCOLS; ++pass) {
                const int c0 = wn * QCOLS + pass * PCOLS;
                float acc[PCOLS / 8][4];
#pragma unroll
                for (int i = 0; i < PCOLS / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
                // dS^T at (key 2t, query wm 16 + g) and K at (key 2t, column c0 + g)
                const float* dr = sds + 2 * t * LS + wm * 16 + g;
                const float* kr = sk + 2 * t * LD + c0 + g;
#pragma unroll
                for (int kk = 0; kk < BN / 8; ++kk) {
                    const float* d8 = dr + kk * 8 * LS;
                    unsigned ab[4], as[4];
                    sk_tf32_split(d8[0], ab[0], as[0]);       // (query g, key 2t)
                    sk_tf32_split(d8[8], ab[1], as[1]);       // (query g + 8, key 2t)
                    sk_tf32_split(d8[LS], ab[2], as[2]);      // (query g, key 2t + 1)
                    sk_tf32_split(d8[LS + 8], ab[3], as[3]);  // (query g + 8, key 2t + 1)
#pragma unroll
                    for (int nb = 0; nb < PCOLS / 8; ++nb) {
                        const float* k8 = kr + kk * 8 * LD + nb * 8;
                        unsigned b0, b1, s0, s1;
                        sk_tf32_split(k8[0], b0, s0);
                        sk_tf32_split(k8[LD], b1, s1);
                        sk_mma_split<PRECISION>(acc[nb], ab, as, b0, b1, s0, s1);
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
            const long long base = ((static_cast<long long>(b) * hk + kh) * lk + j) * D;
#pragma unroll
            for (int db = 0; db < DB; ++db) {
                const int col = db * 8 + 2 * t;
                *reinterpret_cast<float2*>(dk + base + col) =
                    make_float2(dk_acc[db][2 * r] * scale, dk_acc[db][2 * r + 1] * scale);
                *reinterpret_cast<float2*>(dv + base + col) =
                    make_float2(dv_acc[db][2 * r], dv_acc[db][2 * r + 1]);
            }
        }
    }
}
