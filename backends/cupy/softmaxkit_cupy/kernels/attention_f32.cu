// Attention forward of float32 inputs in float32 arithmetic on CUDA cores: the default
// precision="float32" (spec "Attention", "Precision"), every product a float32 fma and every
// sum float32, no tensor-core mode.
//
// The order of work is kernels/attention.cu's (FlashAttention-2): one block computes
// BM = 16 * WARPS query rows of one (batch, head) against key tiles of BN keys,
// double-buffered in shared memory by cp.async, with the online softmax in registers.  The
// two products are register-tiled as a SIMT matrix product is: lane (ty, tx) = (lane / 8,
// lane % 8) of warp w owns the four rows 16 w + ty + 4 i (i < 4) and, of each key tile, the
// keys tx + 8 j (j < BN / 8), and of the output the float4 columns 4 tx + 32 c (c < Dv / 32).
// So a row's keys lie in the eight lanes of its ty (maxima and sums take three shuffles), a
// score takes D / 4 float4 reads of q and k for D fma, and P V takes its probabilities back
// through a warp's own shared-memory tile (rows of BN + 8 floats: the lanes' scalar stores
// and float4 reads fall in distinct banks) and the values as float4 along their columns.
// Q, K and V tiles are rows of D + 4 (Dv + 4) floats: the four rows and eight keys a warp
// reads at once start four banks apart.
#include "mma.cuh"
#include "exclusion.cuh"

#define SK_LN2 0.6931471805599453f
#define SK_LOG2E 1.4426950408889634f

// Forward: q [B, Hq, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, DV] float32 by element strides
// (16-byte aligned rows), out [B, Hq, Lq, DV] and lse [B, Hq, Lq] contiguous; the parameters
// are sk_attn_fwd's.  Two blocks of four warps share a multiprocessor (eight warps: one
// block), each lane with the registers its tiles need.
template <int D, int DV, int WARPS, int BN, bool MASK>
__global__ void __launch_bounds__(WARPS * 32, WARPS > 4 ? 1 : 2) sk_attn_fwd_f32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const unsigned* __restrict__ mask, float* __restrict__ out, float* __restrict__ lse,
    long long q_sb, long long q_sh, long long q_sl, long long k_sb, long long k_sh,
    long long k_sl, long long v_sb, long long v_sh, long long v_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    float scale, float softcap, int offset, int causal, int left, int right) {
    static_assert(D % 4 == 0 && DV % 32 == 0, "float4 rows; eight lanes cover 32 columns");
    static_assert(BN % 32 == 0, "a key tile covers whole 32-key mask words");
    constexpr int BM = 16 * WARPS;
    constexpr int THREADS = 32 * WARPS;
    constexpr int QW = D + 4, VW = DV + 4, PW = BN + 8;  // row widths in shared memory
    constexpr int NJ = BN / 8;                           // a lane's keys of a tile
    constexpr int NC = DV / 32;                          // a lane's float4 output columns
    extern __shared__ __align__(16) unsigned char sk_smem[];
    float* sq = reinterpret_cast<float*>(sk_smem);
    float* sk = sq + BM * QW;      // 2 stages
    float* sv = sk + 2 * BN * QW;  // 2 stages
    float* sp = sv + 2 * BN * VW;  // a [16 x PW] tile of probabilities a warp

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ty = lane / 8, tx = lane % 8;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the most keys under causal first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kh = h / (hq / hk);
    const float* qb = q + b * q_sb + h * q_sh + static_cast<long long>(m0) * q_sl;
    const float* kb = k + b * k_sb + kh * k_sh;
    const float* vb = v + b * v_sb + kh * v_sh;
    const unsigned* mb = MASK && mask ? mask + b * m_sb + h * m_sh : nullptr;

    int n_lo, n_hi;  // keys any row of this block may see
    sk_visible_keys(m0, min(m0 + BM, lq), lk, offset, causal, left, right, n_lo, n_hi);
    const int tile_lo = n_lo / BN;
    const int tile_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : tile_lo;

    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    int rel_lo, rel_hi;
    sk_relative_limits(causal, left, right, rel_lo, rel_hi);

    const int r0 = 16 * warp + ty;  // the lane's first row in the block; rows r0 + 4 i
    float o[4][NC][4];
    float row_max[4], row_sum[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int c = 0; c < NC; ++c) o[i][c][0] = o[i][c][1] = o[i][c][2] = o[i][c][3] = 0.0f;
        row_max[i] = -SK_INF;
        row_sum[i] = 0.0f;
    }

    if (tile_lo < tile_hi) {
        sk_load_padded<BM, D, THREADS>(sq, qb, q_sl, lq - m0);
        sk_load_padded<BN, D, THREADS>(sk, kb + tile_lo * BN * k_sl, k_sl, lk - tile_lo * BN);
        sk_cp_async_commit();
        sk_load_padded<BN, DV, THREADS>(sv, vb + tile_lo * BN * v_sl, v_sl, lk - tile_lo * BN);
        sk_cp_async_commit();
    }
    float* pw = sp + warp * 16 * PW;

    for (int tile = tile_lo; tile < tile_hi; ++tile) {
        const int stage = (tile - tile_lo) & 1;
        const int n0 = tile * BN;
        sk_cp_async_wait<1>();  // this tile's K (and, the first time, Q) has landed
        __syncthreads();
        if (tile + 1 < tile_hi) {
            sk_load_padded<BN, D, THREADS>(sk + (stage ^ 1) * BN * QW, kb + (n0 + BN) * k_sl,
                                           k_sl, lk - n0 - BN);
        }
        sk_cp_async_commit();

        // S = Q K^T: per four columns of the head, four float4 of q and NJ of k, 16 NJ fma
        float s[4][NJ];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j) s[i][j] = 0.0f;
        const float* ks = sk + stage * BN * QW;
#pragma unroll
        for (int d = 0; d < D; d += 4) {
            float4 qv[4], kv[NJ];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                qv[i] = *reinterpret_cast<const float4*>(sq + (r0 + 4 * i) * QW + d);
#pragma unroll
            for (int j = 0; j < NJ; ++j)
                kv[j] = *reinterpret_cast<const float4*>(ks + (tx + 8 * j) * QW + d);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    s[i][j] = fmaf(qv[i].x, kv[j].x, s[i][j]);
                    s[i][j] = fmaf(qv[i].y, kv[j].y, s[i][j]);
                    s[i][j] = fmaf(qv[i].z, kv[j].z, s[i][j]);
                    s[i][j] = fmaf(qv[i].w, kv[j].w, s[i][j]);
                }
            }
        }

        // scores in log2 units, exclusions as -inf
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                float x = s[i][j] * qk_scale;
                if (softcap > 0.0f) x = sk_softcap_log2(x, softcap, inv_cap);
                s[i][j] = x;
            }
        }
        const bool edge = n0 + BN > lk || n0 + BN - 1 > m0 + offset + rel_hi ||
                          n0 < m0 + BM - 1 + offset + rel_lo || mb != nullptr;
        if (edge) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = m0 + r0 + 4 * i;
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    const int key = n0 + tx + 8 * j;
                    const int rel = key - row - offset;
                    if (key >= lk || rel > rel_hi || rel < rel_lo) s[i][j] = -SK_INF;
                }
                if (MASK && mb != nullptr && row < lq) {  // a row past lq is never stored
                    const unsigned* bits = mb + row * m_sq + n0 / 32;
#pragma unroll
                    for (int w = 0; w < BN / 32; ++w) {
                        const unsigned word = n0 + 32 * w < lk ? bits[w] : 0u;
#pragma unroll
                        for (int j = 4 * w; j < 4 * w + 4; ++j)
                            if (!((word >> (tx + 8 * (j - 4 * w))) & 1u)) s[i][j] = -SK_INF;
                    }
                }
            }
        }

        // online softmax: new maxima (over the eight lanes of each row), rescale, exponentiate
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float mx = row_max[i];
#pragma unroll
            for (int j = 0; j < NJ; ++j) mx = fmaxf(mx, s[i][j]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            const float use = mx == -SK_INF ? 0.0f : mx;  // nothing allowed yet: p = 0
            const float rescale = sk_ex2(row_max[i] - use);
            row_max[i] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                s[i][j] = sk_ex2(s[i][j] - use);
                sum += s[i][j];
            }
            row_sum[i] = row_sum[i] * rescale + sum;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                o[i][c][0] *= rescale;
                o[i][c][1] *= rescale;
                o[i][c][2] *= rescale;
                o[i][c][3] *= rescale;
            }
        }
        __syncwarp();  // the last tile's reads of this warp's probabilities are done
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j) pw[(ty + 4 * i) * PW + tx + 8 * j] = s[i][j];

        sk_cp_async_wait<1>();  // this tile's V has landed
        __syncthreads();        // (and every warp's probabilities are stored)
        if (tile + 1 < tile_hi) {
            sk_load_padded<BN, DV, THREADS>(sv + (stage ^ 1) * BN * VW, vb + (n0 + BN) * v_sl,
                                            v_sl, lk - n0 - BN);
        }
        sk_cp_async_commit();

        // O += P V: per four keys, four float4 of P and 4 NC of v, 64 NC fma
        const float* vs = sv + stage * BN * VW;
#pragma unroll
        for (int n = 0; n < BN; n += 4) {
            float4 p[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                p[i] = *reinterpret_cast<const float4*>(pw + (ty + 4 * i) * PW + n);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const float4 vv =
                        *reinterpret_cast<const float4*>(vs + (n + u) * VW + 4 * tx + 32 * c);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float pu = u == 0 ? p[i].x : u == 1 ? p[i].y : u == 2 ? p[i].z
                                                                                    : p[i].w;
                        o[i][c][0] = fmaf(pu, vv.x, o[i][c][0]);
                        o[i][c][1] = fmaf(pu, vv.y, o[i][c][1]);
                        o[i][c][2] = fmaf(pu, vv.z, o[i][c][2]);
                        o[i][c][3] = fmaf(pu, vv.w, o[i][c][3]);
                    }
                }
            }
        }
    }
    sk_cp_async_wait<0>();

    // finish: the row's sum over its eight lanes, normalize, store out and lse
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float l = row_sum[i];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        l += __shfl_xor_sync(0xffffffffu, l, 4);
        const int row = m0 + r0 + 4 * i;
        if (row < lq) {
            const float inv = l == 0.0f ? 0.0f : 1.0f / l;  // a NaN sum stays NaN
            const long long at = (static_cast<long long>(b) * hq + h) * lq + row;
            float* orow = out + at * DV;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                *reinterpret_cast<float4*>(orow + 4 * tx + 32 * c) =
                    make_float4(o[i][c][0] * inv, o[i][c][1] * inv, o[i][c][2] * inv,
                                o[i][c][3] * inv);
            }
            if (lse && tx == 0) lse[at] = l == 0.0f ? -SK_INF : (row_max[i] + log2f(l)) * SK_LN2;
        }
    }
}
