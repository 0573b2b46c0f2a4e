// Attention forward of float32 inputs in float32 arithmetic on CUDA cores: the default
// precision="float32" (spec "Attention", "Precision"), every product a float32 fma and every
// sum float32, no tensor-core mode.
//
// The order of work is kernels/attention.cu's (FlashAttention-2): one block computes
// BM = TY R WARPS query rows of one (batch, head) against key tiles of BN keys,
// double-buffered in shared memory by cp.async, with the online softmax in registers.  The
// two products are register-tiled as a SIMT matrix product is: in row groups of TX = 8 (or
// 16) lanes, lane (ty, tx) = (lane / TX, lane % TX) of warp w owns the R rows
// TY R w + ty + TY i (i < R, TY = 32 / TX) and, of each key tile, the keys tx + TX j
// (j < BN / TX), and of the output the float4 columns 4 tx + 4 TX c (c < Dv / (4 TX)).
// So a row's keys lie in the TX lanes of its ty (maxima and sums take log2 TX shuffles), a
// score takes D / 4 float4 reads of q and k for D fma, and P V takes its probabilities back
// through a warp's own shared-memory tile (rows of BN + TX floats: the lanes' scalar stores
// and float4 reads fall in distinct banks) and the values as float4 along their columns.
// Q, K and V tiles are rows of D + 4 (Dv + 4) floats: the rows and the eight keys a quarter
// warp reads at once start four banks apart.
#include "mma.cuh"
#include "exclusion.cuh"
#include "bwd_pre.cuh"

#define SK_LN2 0.6931471805599453f
#define SK_LOG2E 1.4426950408889634f

// acc[i][c] += sum over n < N of a[(ty + TY i) * AW + n] * b[n * BW + 4 tx + 4 TX c .. + 3]:
// the lane's R rows of a shared [rows x N] tile times a shared [N x 4 TX NC] tile, float4
// reads, for lanes (ty, tx) of TX lanes a row group and TY = 32 / TX groups a warp.
template <int N, int NC, int AW, int BW, int R, int TX = 8>
__device__ __forceinline__ void sk_f32_rows_times(float (&acc)[R][NC][4], const float* a,
                                                  const float* b, int ty, int tx) {
    constexpr int TY = 32 / TX;
#pragma unroll
    for (int n = 0; n < N; n += 4) {
        float4 p[R];
#pragma unroll
        for (int i = 0; i < R; ++i)
            p[i] = *reinterpret_cast<const float4*>(a + (ty + TY * i) * AW + n);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4 bv =
                    *reinterpret_cast<const float4*>(b + (n + u) * BW + 4 * tx + 4 * TX * c);
#pragma unroll
                for (int i = 0; i < R; ++i) {
                    const float pu = u == 0 ? p[i].x : u == 1 ? p[i].y : u == 2 ? p[i].z : p[i].w;
                    acc[i][c][0] = fmaf(pu, bv.x, acc[i][c][0]);
                    acc[i][c][1] = fmaf(pu, bv.y, acc[i][c][1]);
                    acc[i][c][2] = fmaf(pu, bv.z, acc[i][c][2]);
                    acc[i][c][3] = fmaf(pu, bv.w, acc[i][c][3]);
                }
            }
        }
    }
}

// acc[i][j] += a[(ty + TY i) * W + .] . b[(tx + TX j) * W + .] over the K columns of two
// shared tiles of row width W: the lane's R rows of one against its NJ rows of the other.
template <int K, int NJ, int W, int R, int TX = 8>
__device__ __forceinline__ void sk_f32_rows_dot(float (&acc)[R][NJ], const float* a,
                                                const float* b, int ty, int tx) {
    constexpr int TY = 32 / TX;
#pragma unroll
    for (int d = 0; d < K; d += 4) {
        float4 av[R], bv[NJ];
#pragma unroll
        for (int i = 0; i < R; ++i)
            av[i] = *reinterpret_cast<const float4*>(a + (ty + TY * i) * W + d);
#pragma unroll
        for (int j = 0; j < NJ; ++j)
            bv[j] = *reinterpret_cast<const float4*>(b + (tx + TX * j) * W + d);
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                acc[i][j] = fmaf(av[i].x, bv[j].x, acc[i][j]);
                acc[i][j] = fmaf(av[i].y, bv[j].y, acc[i][j]);
                acc[i][j] = fmaf(av[i].z, bv[j].z, acc[i][j]);
                acc[i][j] = fmaf(av[i].w, bv[j].w, acc[i][j]);
            }
        }
    }
}

// The forward's body, for two layouts chosen at compile time (as kernels/attention.cu's).
// Dense (VARLEN = false): q [B, Hq, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, DV] float32 by
// element strides (16-byte aligned rows), out [B, Hq, Lq, DV] and lse [B, Hq, Lq] contiguous;
// the parameters are sk_attn_fwd's.  Packed variable-length (VARLEN = true, spec "Packed
// variable-length attention"): q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, DV] by token and head
// strides, out [Tq, Hq, DV] and lse [Tq, Hq] contiguous; batch b of the grid is sequence b,
// whose queries are the tokens cu_q[b] .. cu_q[b + 1] and keys cu_k[b] .. cu_k[b + 1], with
// its own lq, lk and causal offset (``offset`` 1: bottom-right alignment, 0: top-left); the
// grid's row tiles cover the longest sequence, and a shorter one's blocks past its first
// tile return at once, its last tile taking the index the dense last tile takes.  Each lane
// has the registers its tiles need (two blocks of up to four warps a multiprocessor, one of
// eight: the wrappers' launch bounds).  TX = 16 lanes a row group halve a lane's output
// columns (and keys of a tile), so that eight rows a lane fit its registers with eight warps
// a multiprocessor.  VS stages of V: with two, the next tile's V loads over this tile's P V;
// with one (the block's shared memory within a multiprocessor's at eight rows a lane), a
// tile's V loads over its scores.  KS stages of K: with two, the next tile's K loads over this
// tile's scores and P V; with one (and one of V), over its P V alone, so that a tile of 64 keys
// fits beside a wide Q tile.
template <int D, int DV, int WARPS, int BN, bool MASK, int R, int TX, int VS, int KS,
          bool VARLEN>
__device__ __forceinline__ void sk_attn_fwd_f32_body(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const unsigned* __restrict__ mask, float* __restrict__ out, float* __restrict__ lse,
    const long long* __restrict__ cu_q, const long long* __restrict__ cu_k, long long q_sb,
    long long q_sh, long long q_sl, long long k_sb, long long k_sh, long long k_sl,
    long long v_sb, long long v_sh, long long v_sl, long long m_sb, long long m_sh,
    long long m_sq, int hq, int hk, int lq, int lk,
    float scale, float softcap, int offset, int causal, int left, int right) {
    static_assert(TX == 8 || TX == 16, "a row group of eight or sixteen lanes");
    constexpr int TY = 32 / TX;  // row groups a warp
    static_assert(D % 4 == 0 && DV % (4 * TX) == 0,
                  "float4 rows; a row group's lanes cover 4 TX columns");
    static_assert(BN % 32 == 0 && BN % TX == 0, "a key tile covers whole 32-key mask words");
    static_assert(VS == 1 || VS == 2, "one or two stages of V");
    static_assert(KS == 2 || (KS == 1 && VS == 1), "one stage of K takes one of V");
    constexpr int WR = TY * R;  // a warp's query rows
    constexpr int BM = WR * WARPS;
    constexpr int THREADS = 32 * WARPS;
    // row widths in shared memory: PW = TX mod 32 puts a warp's scalar stores of P (rows
    // ty + TY i, columns tx + TX j) in 32 distinct banks
    constexpr int QW = D + 4, VW = DV + 4, PW = BN + TX;
    constexpr int NJ = BN / TX;        // a lane's keys of a tile
    constexpr int NC = DV / (4 * TX);  // a lane's float4 output columns
    extern __shared__ __align__(16) unsigned char sk_smem[];
    float* sq = reinterpret_cast<float*>(sk_smem);
    float* sk = sq + BM * QW;       // KS stages
    float* sv = sk + KS * BN * QW;  // VS stages
    float* sp = sv + VS * BN * VW;  // a [WR x PW] tile of probabilities a warp

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ty = lane / TX, tx = lane % TX;
    int m0, h, b;
    sk_row_block(causal, BM, m0, h, b);
    const int kh = h / (hq / hk);
    const float *qb, *kb, *vb;
    if constexpr (VARLEN) {
        const long long q_tok = cu_q[b], k_tok = cu_k[b];
        lq = static_cast<int>(cu_q[b + 1] - q_tok);
        lk = static_cast<int>(cu_k[b + 1] - k_tok);
        offset = offset ? lk - lq : 0;
        const int tiles = causal == SK_LONGEST_FIRST ? gridDim.z : gridDim.x;
        m0 -= (tiles - (lq + BM - 1) / BM) * BM;
        if (m0 < 0) return;  // past this sequence's first tile
        qb = q + (q_tok + m0) * q_sl + h * q_sh;
        kb = k + k_tok * k_sl + kh * k_sh;
        vb = v + k_tok * v_sl + kh * v_sh;
        out += q_tok * hq * DV;  // the sequence's rows of out [Tq, Hq, DV] and lse [Tq, Hq]
        lse += q_tok * hq;
    } else {
        qb = q + b * q_sb + h * q_sh + static_cast<long long>(m0) * q_sl;
        kb = k + b * k_sb + kh * k_sh;
        vb = v + b * v_sb + kh * v_sh;
    }
    const unsigned* mb = MASK && mask ? mask + b * m_sb + h * m_sh : nullptr;

    int n_lo, n_hi;  // keys any row of this block may see
    sk_visible_keys(m0, min(m0 + BM, lq), lk, offset, causal, left, right, n_lo, n_hi);
    const int tile_lo = n_lo / BN;
    const int tile_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : tile_lo;

    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    int rel_lo, rel_hi;
    sk_relative_limits(causal, left, right, rel_lo, rel_hi);

    const int r0 = WR * warp + ty;  // the lane's first row in the block; rows r0 + TY i
    float o[R][NC][4];
    float row_max[R], row_sum[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int c = 0; c < NC; ++c) o[i][c][0] = o[i][c][1] = o[i][c][2] = o[i][c][3] = 0.0f;
        row_max[i] = -SK_INF;
        row_sum[i] = 0.0f;
    }

    if (tile_lo < tile_hi) {
        sk_load_padded<BM, D, THREADS>(sq, qb, q_sl, lq - m0);
        sk_load_padded<BN, D, THREADS>(sk, kb + tile_lo * BN * k_sl, k_sl, lk - tile_lo * BN);
        sk_cp_async_commit();
        if (VS == 2) {
            sk_load_padded<BN, DV, THREADS>(sv, vb + tile_lo * BN * v_sl, v_sl,
                                            lk - tile_lo * BN);
        }
        sk_cp_async_commit();
    }
    float* pw = sp + warp * WR * PW;

    for (int tile = tile_lo; tile < tile_hi; ++tile) {
        const int stage = (tile - tile_lo) & 1;
        const int n0 = tile * BN;
        // this tile's K (and, the first time, Q) has landed, and every warp is done with the
        // stages the loads below overwrite
        sk_cp_async_wait<VS == 2 ? 1 : 0>();
        __syncthreads();
        if (VS == 1) {
            sk_load_padded<BN, DV, THREADS>(sv, vb + n0 * v_sl, v_sl, lk - n0);
            sk_cp_async_commit();
        }
        if (KS == 2 && tile + 1 < tile_hi) {
            sk_load_padded<BN, D, THREADS>(sk + (stage ^ 1) * BN * QW, kb + (n0 + BN) * k_sl,
                                           k_sl, lk - n0 - BN);
        }
        sk_cp_async_commit();

        // S = Q K^T: per four columns of the head, R float4 of q and NJ of k, 4 R NJ fma
        float s[R][NJ];
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j) s[i][j] = 0.0f;
        sk_f32_rows_dot<D, NJ, QW, R, TX>(s, sq + WR * warp * QW,
                                          sk + (KS == 2 ? stage : 0) * BN * QW, ty, tx);

        // scores in log2 units, exclusions as -inf
#pragma unroll
        for (int i = 0; i < R; ++i) {
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
            for (int i = 0; i < R; ++i) {
                const int row = m0 + r0 + TY * i;
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    const int key = n0 + tx + TX * j;
                    if (sk_outside(key, lk, key - row - offset, rel_lo, rel_hi)) s[i][j] = -SK_INF;
                }
                if (MASK && mb != nullptr && row < lq) {  // a row past lq is never stored
                    const unsigned* bits = mb + row * m_sq + n0 / 32;
#pragma unroll
                    for (int w = 0; w < BN / 32; ++w) {
                        const unsigned word = n0 + 32 * w < lk ? bits[w] : 0u;
                        constexpr int JW = 32 / TX;  // a lane's keys of a mask word
#pragma unroll
                        for (int j = JW * w; j < JW * w + JW; ++j)
                            if (!((word >> (tx + TX * (j - JW * w))) & 1u)) s[i][j] = -SK_INF;
                    }
                }
            }
        }

        // online softmax: new maxima (over the TX lanes of each row), rescale, exponentiate
#pragma unroll
        for (int i = 0; i < R; ++i) {
            float mx = row_max[i];
#pragma unroll
            for (int j = 0; j < NJ; ++j) mx = fmaxf(mx, s[i][j]);
#pragma unroll
            for (int x = 1; x < TX; x *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
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
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j) pw[(ty + TY * i) * PW + tx + TX * j] = s[i][j];

        sk_cp_async_wait<1>();  // this tile's V has landed (the next K may not have)
        __syncthreads();        // (and every warp's probabilities are stored, its scores done)
        if (KS == 1) {
            if (tile + 1 < tile_hi) {
                sk_load_padded<BN, D, THREADS>(sk, kb + (n0 + BN) * k_sl, k_sl, lk - n0 - BN);
            }
            sk_cp_async_commit();
        }
        if (VS == 2) {
            if (tile + 1 < tile_hi) {
                sk_load_padded<BN, DV, THREADS>(sv + (stage ^ 1) * BN * VW,
                                                vb + (n0 + BN) * v_sl, v_sl, lk - n0 - BN);
            }
            sk_cp_async_commit();
        }

        // O += P V: per four keys, R float4 of P and 4 NC of v, 16 R NC fma
        sk_f32_rows_times<BN, NC, PW, VW, R, TX>(o, pw, sv + (VS == 2 ? stage : 0) * BN * VW,
                                                  ty, tx);
    }
    sk_cp_async_wait<0>();

    // finish: the row's sum over its TX lanes, normalize, store out and lse
#pragma unroll
    for (int i = 0; i < R; ++i) {
        float l = row_sum[i];
#pragma unroll
        for (int x = 1; x < TX; x *= 2) l += __shfl_xor_sync(0xffffffffu, l, x);
        const int row = m0 + r0 + TY * i;
        if (row < lq) {
            const float inv = l == 0.0f ? 0.0f : 1.0f / l;  // a NaN sum stays NaN
            const long long at = VARLEN ? static_cast<long long>(row) * hq + h
                                        : (static_cast<long long>(b) * hq + h) * lq + row;
            float* orow = out + at * DV;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                *reinterpret_cast<float4*>(orow + 4 * tx + 4 * TX * c) =
                    make_float4(o[i][c][0] * inv, o[i][c][1] * inv, o[i][c][2] * inv,
                                o[i][c][3] * inv);
            }
            if (lse && tx == 0) lse[at] = l == 0.0f ? -SK_INF : (row_max[i] + log2f(l)) * SK_LN2;
        }
    }
}

// The dense forward (the body's dense layout).  Two blocks of up to four warps share a
// multiprocessor; eight warps take one.
template <int D, int DV, int WARPS, int BN, bool MASK, int R = 4, int TX = 8, int VS = 2,
          int KS = 2>
__global__ void __launch_bounds__(WARPS * 32, WARPS > 4 ? 1 : 2) sk_attn_fwd_f32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const unsigned* __restrict__ mask, float* __restrict__ out, float* __restrict__ lse,
    long long q_sb, long long q_sh, long long q_sl, long long k_sb, long long k_sh,
    long long k_sl, long long v_sb, long long v_sh, long long v_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    float scale, float softcap, int offset, int causal, int left, int right) {
    sk_attn_fwd_f32_body<D, DV, WARPS, BN, MASK, R, TX, VS, KS, false>(
        q, k, v, mask, out, lse, nullptr, nullptr, q_sb, q_sh, q_sl, k_sb, k_sh, k_sl, v_sb,
        v_sh, v_sl, m_sb, m_sh, m_sq, hq, hk, lq, lk, scale, softcap, offset, causal, left,
        right);
}

// The packed variable-length forward (the body's packed layout): the grid of the dense
// forward for B sequences as long as the longest (softmaxkit_cupy.attention.forward_grid),
// the parameters sk_attn_fwd_varlen's (kernels/attention.cu).
template <int D, int DV, int WARPS, int BN, int R = 4, int TX = 8, int VS = 2, int KS = 2>
__global__ void __launch_bounds__(WARPS * 32, WARPS > 4 ? 1 : 2) sk_attn_fwd_f32_varlen(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const long long* __restrict__ cu_q, const long long* __restrict__ cu_k,
    float* __restrict__ out, float* __restrict__ lse, long long q_st, long long q_sh,
    long long k_st, long long k_sh, long long v_st, long long v_sh, int hq, int hk,
    float scale, float softcap, int bottom_right, int causal, int left, int right) {
    sk_attn_fwd_f32_body<D, DV, WARPS, BN, false, R, TX, VS, KS, true>(
        q, k, v, nullptr, out, lse, cu_q, cu_k, 0, q_sh, q_st, 0, k_sh, k_st, 0, v_sh, v_st,
        0, 0, 0, hq, hk, 0, 0, scale, softcap, bottom_right, causal, left, right);
}

// dst[i] = src[i], i < N: N consecutive floats of shared memory as float4 (or float2) reads
template <int N>
__device__ __forceinline__ void sk_f32_load_run(float (&dst)[N], const float* src) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4 x = *reinterpret_cast<const float4*>(src + i);
            dst[i] = x.x, dst[i + 1] = x.y, dst[i + 2] = x.z, dst[i + 3] = x.w;
        }
    } else if constexpr (N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 2) {
            const float2 x = *reinterpret_cast<const float2*>(src + i);
            dst[i] = x.x, dst[i + 1] = x.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = src[i];
    }
}

__host__ __device__ constexpr int sk_gcd(int a, int b) { return b == 0 ? a : sk_gcd(b, a % b); }

// --- backward -------------------------------------------------------------------------------
//
// The gradient of attention (spec "Gradients") in float32 arithmetic, in kernels/attention_bwd.cu's
// order: block (key tile, key head, batch) holds BN = 4 KL WARPS keys' K and V in shared
// memory while the query tiles of BM rows of every query head of the group stream through two
// stages; lane (ty, tx) of warp w owns the keys 4 KL w + ty + 4 i (i < KL) and, of each query
// tile, the queries tx + 8 j (j < BM / 8) of S^T and dP^T, and the float4 columns 4 tx + 32 c
// of dK and dV, accumulated in registers.  P^T and then dS^T go through shared memory (rows
// of BM + 8 floats): a warp's own rows for dV = P^T dO and dK = dS^T Q, the whole tile for
// dQ = dS K, whose [BM x D] partial product (the warps split its columns and queries, a lane
// QL consecutive queries of NQ float4 columns) is added into a float32 buffer.  The adapter
// gives lse2 = lse log2 e (+inf for a row with no allowed key and for padding rows, so their
// P is 0) and delta = rowsum(dO O) - dlse, both [B * Hq, lq_pad], and scales dQ's buffer.

// The backward's body, for two layouts chosen at compile time.  Dense (VARLEN = false):
// q [B, Hq, Lq, D], dO [B, Hq, Lq, DV], k [B, Hk, Lk, D], v [B, Hk, Lk, DV] float32 by element
// strides (16-byte aligned rows); lse2, delta [B * Hq, lq_pad], dq_acc [B * Hq, lq_pad, D]
// (zeroed); dk [B, Hk, Lk, D], dv [B, Hk, Lk, DV] contiguous.  Packed variable-length
// (VARLEN = true): q, dO [Tq, Hq, .], k, v [Tk, Hk, .] by token and head strides, dk, dv
// and dq_acc (zeroed) [T., H., .] contiguous, batch b of the grid sequence b (as in the
// forward's body); its rows of lse2 and delta [Hq, tpad] start at cu_pad[b] in each head's
// tpad (``lq_pad``) rows, cu_pad holding the query lengths rounded up to BM, summed
// (sk_attn_bwd_pre_varlen's layout); the blocks past a sequence's keys return.
template <int D, int DV, int WARPS, int BM, bool MASK, int KL, bool VARLEN>
__device__ __forceinline__ void sk_attn_bwd_f32_body(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ dout, const unsigned* __restrict__ mask,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    float* __restrict__ dk, float* __restrict__ dv, const long long* __restrict__ cu_q,
    const long long* __restrict__ cu_k, const long long* __restrict__ cu_pad, long long q_sb,
    long long q_sh, long long q_sl, long long k_sb, long long k_sh, long long k_sl,
    long long v_sb, long long v_sh, long long v_sl, long long g_sb, long long g_sh,
    long long g_sl, long long m_sb, long long m_sh, long long m_sq, int hq, int hk, int lq,
    int lk, int lq_pad, float scale, float softcap, int offset, int causal, int left,
    int right) {
    static_assert(D % 32 == 0 && DV % 32 == 0, "eight lanes cover 32 columns");
    static_assert(BM % 8 == 0, "whole query groups a lane");
    constexpr int BN = 4 * KL * WARPS;
    constexpr int THREADS = 32 * WARPS;
    constexpr int KW = D + 4, VW = DV + 4, SW = BM + 8;  // row widths in shared memory
    constexpr int NJ = BM / 8;                           // a lane's queries of a tile
    constexpr int NK = D / 32, NV = DV / 32;             // a lane's float4 columns of dK, dV
    extern __shared__ __align__(16) unsigned char sk_smem[];
    float* sk = reinterpret_cast<float*>(sk_smem);
    float* sv = sk + BN * KW;
    float* sq = sv + BN * VW;        // 2 stages
    float* sg = sq + 2 * BM * KW;    // dO, 2 stages
    float* sds = sg + 2 * BM * VW;   // P^T, then dS^T [BN x SW]
    float* sl = sds + BN * SW;       // lse2, 2 stages
    float* sd = sl + 2 * BM;         // delta, 2 stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ty = lane / 8, tx = lane % 8;
    const int n0 = blockIdx.x * BN, kh = blockIdx.y, b = blockIdx.z;
    const int group = hq / hk;
    // packed: the sequence's first query and key tokens and first row of lse2 and delta
    long long q_tok = 0, k_tok = 0, row0 = 0;
    const float *kb, *vb;
    if constexpr (VARLEN) {
        q_tok = cu_q[b], k_tok = cu_k[b], row0 = cu_pad[b];
        lq = static_cast<int>(cu_q[b + 1] - q_tok);
        lk = static_cast<int>(cu_k[b + 1] - k_tok);
        offset = offset ? lk - lq : 0;
        if (n0 >= lk) return;  // past this sequence's keys
        kb = k + (k_tok + n0) * k_sl + kh * k_sh;
        vb = v + (k_tok + n0) * v_sl + kh * v_sh;
        dk += k_tok * hk * D;  // the sequence's rows of dk and dv [Tk, Hk, .]
        dv += k_tok * hk * DV;
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
        const long long qo = VARLEN ? h * q_sh + (q_tok + m0) * q_sl
                                    : b * q_sb + h * q_sh + static_cast<long long>(m0) * q_sl;
        const long long go = VARLEN ? h * g_sh + (q_tok + m0) * g_sl
                                    : b * g_sb + h * g_sh + static_cast<long long>(m0) * g_sl;
        sk_load_padded<BM, D, THREADS>(sq + st * BM * KW, q + qo, q_sl, lq - m0);
        sk_load_padded<BM, DV, THREADS>(sg + st * BM * VW, dout + go, g_sl, lq - m0);
        const long long ro = VARLEN ? row0 + static_cast<long long>(h) * lq_pad + m0
                                    : (static_cast<long long>(b) * hq + h) * lq_pad + m0;
        for (int c = threadIdx.x; c < BM / 2; c += THREADS) {  // BM / 4 chunks of each
            const bool is_l = c < BM / 4;
            const int cc = is_l ? c : c - BM / 4;
            sk_cp_async16((is_l ? sl : sd) + st * BM + 4 * cc, (is_l ? lse2 : delta) + ro + 4 * cc,
                          true);
        }
    };

    float dk_acc[KL][NK][4], dv_acc[KL][NV][4];
#pragma unroll
    for (int i = 0; i < KL; ++i) {
#pragma unroll
        for (int c = 0; c < NK; ++c)
            dk_acc[i][c][0] = dk_acc[i][c][1] = dk_acc[i][c][2] = dk_acc[i][c][3] = 0.0f;
#pragma unroll
        for (int c = 0; c < NV; ++c)
            dv_acc[i][c][0] = dv_acc[i][c][1] = dv_acc[i][c][2] = dv_acc[i][c][3] = 0.0f;
    }
    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const float th_scale = softcap > 0.0f ? 1.0f / (softcap * SK_LOG2E) : 0.0f;
    int rel_lo, rel_hi;
    sk_relative_limits(causal, left, right, rel_lo, rel_hi);
    const int w0 = 4 * KL * warp;      // this warp's first key in the tile
    const float* kw = sk + w0 * KW;    // the warp's rows of K, V and of P^T / dS^T
    const float* vw = sv + w0 * VW;
    float* dsw = sds + w0 * SW;

    if (total > 0) {
        sk_load_padded<BN, D, THREADS>(sk, kb, k_sl, lk - n0);
        sk_load_padded<BN, DV, THREADS>(sv, vb, v_sl, lk - n0);
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
        const float* sqs = sq + st * BM * KW;
        const float* sgs = sg + st * BM * VW;
        const float* sls = sl + st * BM;
        const float* sdl = sd + st * BM;

        // S^T = K_w Q^T and dP^T = V_w dO^T: the lane's KL keys x NJ queries
        float s[KL][NJ], dp[KL][NJ];
#pragma unroll
        for (int i = 0; i < KL; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j) s[i][j] = dp[i][j] = 0.0f;
        sk_f32_rows_dot<D, NJ, KW, KL>(s, kw, sqs, ty, tx);
        sk_f32_rows_dot<DV, NJ, VW, KL>(dp, vw, sgs, ty, tx);

        // scores in log2 units (softcapped: softcap tanh(s / softcap)), exclusions as -inf
#pragma unroll
        for (int i = 0; i < KL; ++i) {
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                float x = s[i][j] * qk_scale;
                if (softcap > 0.0f) x = sk_softcap_log2(x, softcap, inv_cap);
                s[i][j] = x;
            }
        }
        const unsigned* mh = MASK && mask ? mask + b * m_sb + h * m_sh : nullptr;
        const bool edge = n0 + BN > lk || n0 + BN - 1 > m0 + offset + rel_hi ||
                          n0 < m0 + BM - 1 + offset + rel_lo || mh != nullptr;
        if (edge) {
#pragma unroll
            for (int i = 0; i < KL; ++i) {
                const int key = n0 + w0 + ty + 4 * i;
                // this key's mask word for the tile's queries: one per query row
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    const int row = m0 + tx + 8 * j;
                    bool out = sk_outside(key, lk, key - row - offset, rel_lo, rel_hi);
                    if (MASK && mh != nullptr && !out) {
                        const unsigned word = mh[min(row, lq - 1) * m_sq + (key >> 5)];
                        out = !((word >> (key & 31)) & 1u);
                    }
                    if (out) s[i][j] = -SK_INF;
                }
            }
        }
        // P^T = exp2(S^T - lse2) and dS^T = P^T (dP^T - delta), times 1 - tanh^2 under
        // softcap (tanh clamped so excluded scores, -inf, give 0, not 0 * inf)
#pragma unroll
        for (int i = 0; i < KL; ++i) {
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int c = tx + 8 * j;  // query column in the tile
                const float p = sk_ex2(s[i][j] - sls[c]);
                const float th = fmaxf(s[i][j] * th_scale, -1.0f);
                s[i][j] = p;
                dp[i][j] = p * (dp[i][j] - sdl[c]) * (1.0f - th * th);
            }
        }

        // dV_w += P^T dO, through the warp's rows of the shared tile
#pragma unroll
        for (int i = 0; i < KL; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j) dsw[(ty + 4 * i) * SW + tx + 8 * j] = s[i][j];
        __syncwarp();
        sk_f32_rows_times<BM, NV, SW, VW, KL>(dv_acc, dsw, sgs, ty, tx);
        __syncwarp();  // every lane has read P^T
        // dK_w += dS^T Q, and dS^T stays for dQ
#pragma unroll
        for (int i = 0; i < KL; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j) dsw[(ty + 4 * i) * SW + tx + 8 * j] = dp[i][j];
        __syncthreads();  // every warp's dS^T is stored
        sk_f32_rows_times<BM, NK, SW, KW, KL>(dk_acc, dsw, sqs, ty, tx);

        // dQ[BM x D] += dS K (unscaled) over the tile's BN keys, added into the float32
        // buffer.  The warps split the columns WD ways and the queries WARPS / WD ways:
        // lane (ty, tx) holds QL consecutive queries and NQ float4 columns, so that a key
        // takes one read of its dS (two addresses a half warp) and NQ of K for 4 QL NQ fma
        {
            constexpr int WD = sk_gcd(WARPS, D / 32), WQ = WARPS / WD;
            constexpr int QL = BM / (4 * WQ), NQ = D / (32 * WD);
            static_assert(BM % (4 * WQ) == 0, "whole query runs a lane");
            const int q0 = warp / WD * (BM / WQ) + QL * ty;
            const int c0 = warp % WD * (D / WD) + 4 * tx;
            float acc[QL][NQ][4];
#pragma unroll
            for (int i = 0; i < QL; ++i)
#pragma unroll
                for (int c = 0; c < NQ; ++c)
                    acc[i][c][0] = acc[i][c][1] = acc[i][c][2] = acc[i][c][3] = 0.0f;
#pragma unroll 4
            for (int n = 0; n < BN; ++n) {
                float dsv[QL];
                sk_f32_load_run<QL>(dsv, sds + n * SW + q0);
#pragma unroll
                for (int c = 0; c < NQ; ++c) {
                    const float4 kv = *reinterpret_cast<const float4*>(sk + n * KW + c0 + 32 * c);
#pragma unroll
                    for (int i = 0; i < QL; ++i) {
                        acc[i][c][0] = fmaf(dsv[i], kv.x, acc[i][c][0]);
                        acc[i][c][1] = fmaf(dsv[i], kv.y, acc[i][c][1]);
                        acc[i][c][2] = fmaf(dsv[i], kv.z, acc[i][c][2]);
                        acc[i][c][3] = fmaf(dsv[i], kv.w, acc[i][c][3]);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < QL; ++i) {
                // packed: dq's rows without padding, so a tile's rows past the sequence add
                // nothing
                if (VARLEN && m0 + q0 + i >= lq) break;
                float* qrow = dq_acc + (VARLEN ? (q_tok + m0 + q0 + i) * hq + h
                                               : (static_cast<long long>(b) * hq + h) * lq_pad +
                                                     m0 + q0 + i) * D;
#pragma unroll
                for (int c = 0; c < NQ; ++c) {
                    sk_red_add2(qrow + c0 + 32 * c, acc[i][c][0], acc[i][c][1]);
                    sk_red_add2(qrow + c0 + 32 * c + 2, acc[i][c][2], acc[i][c][3]);
                }
            }
        }
        __syncthreads();  // dS^T and this stage are read before they are written again
    }
    sk_cp_async_wait<0>();

    // dK (scaled) and dV of the lane's keys; keys of a tile no query sees get zeros
#pragma unroll
    for (int i = 0; i < KL; ++i) {
        const int j = n0 + w0 + ty + 4 * i;
        if (j < lk) {
            const long long row = VARLEN ? static_cast<long long>(j) * hk + kh
                                         : (static_cast<long long>(b) * hk + kh) * lk + j;
#pragma unroll
            for (int c = 0; c < NK; ++c) {
                *reinterpret_cast<float4*>(dk + row * D + 4 * tx + 32 * c) =
                    make_float4(dk_acc[i][c][0] * scale, dk_acc[i][c][1] * scale,
                                dk_acc[i][c][2] * scale, dk_acc[i][c][3] * scale);
            }
#pragma unroll
            for (int c = 0; c < NV; ++c) {
                *reinterpret_cast<float4*>(dv + row * DV + 4 * tx + 32 * c) =
                    make_float4(dv_acc[i][c][0], dv_acc[i][c][1], dv_acc[i][c][2],
                                dv_acc[i][c][3]);
            }
        }
    }
}

// The dense backward (the body's dense layout); the parameters are sk_attn_bwd's
// (kernels/attention_bwd.cu).
template <int D, int DV, int WARPS, int BM, bool MASK, int KL = 4>
__global__ void __launch_bounds__(WARPS * 32, WARPS > 4 ? 1 : 2) sk_attn_bwd_f32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ dout, const unsigned* __restrict__ mask,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    float* __restrict__ dk, float* __restrict__ dv, long long q_sb, long long q_sh,
    long long q_sl, long long k_sb, long long k_sh, long long k_sl, long long v_sb,
    long long v_sh, long long v_sl, long long g_sb, long long g_sh, long long g_sl,
    long long m_sb, long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    int lq_pad, float scale, float softcap, int offset, int causal, int left, int right) {
    sk_attn_bwd_f32_body<D, DV, WARPS, BM, MASK, KL, false>(
        q, k, v, dout, mask, lse2, delta, dq_acc, dk, dv, nullptr, nullptr, nullptr, q_sb,
        q_sh, q_sl, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, g_sb, g_sh, g_sl, m_sb, m_sh, m_sq,
        hq, hk, lq, lk, lq_pad, scale, softcap, offset, causal, left, right);
}

// The packed variable-length backward (the body's packed layout): grid (key tiles of the
// longest sequence, Hk, B); the parameters sk_attn_bwd_varlen's (kernels/attention_bwd.cu).
template <int D, int DV, int WARPS, int BM, int KL = 4>
__global__ void __launch_bounds__(WARPS * 32, WARPS > 4 ? 1 : 2) sk_attn_bwd_f32_varlen(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ dout, const long long* __restrict__ cu_q,
    const long long* __restrict__ cu_k, const long long* __restrict__ cu_pad,
    const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc,
    float* __restrict__ dk, float* __restrict__ dv, long long q_st, long long q_sh,
    long long k_st, long long k_sh, long long v_st, long long v_sh, long long g_st,
    long long g_sh, int hq, int hk, int tpad, float scale, float softcap, int bottom_right,
    int causal, int left, int right) {
    sk_attn_bwd_f32_body<D, DV, WARPS, BM, false, KL, true>(
        q, k, v, dout, nullptr, lse2, delta, dq_acc, dk, dv, cu_q, cu_k, cu_pad, 0, q_sh, q_st,
        0, k_sh, k_st, 0, v_sh, v_st, 0, g_sh, g_st, 0, 0, 0, hq, hk, 0, 0, tpad, scale,
        softcap, bottom_right, causal, left, right);
}

// --- split-KV decoding ------------------------------------------------------------------------
//
// Decoding in float32 arithmetic (few query rows per key head: G query heads sharing one key
// head, times Lq, at most 16 rows), the work split over the keys as kernels/attention.cu's
// sk_attn_decode splits it: block (split, key head, batch) walks keys [split * chunk,
// (split + 1) * chunk) of the sequence in tiles of 32 keys, K and V tiles in a ring of STAGES
// stages (rows of D + 4 floats), and writes a partial (out, lse) merged over the splits by
// sk_merge_attn.  Warp w owns query rows w, w + WARPS, ... (RW = 16 / WARPS of them) over
// every key, so the warps never merge: lane j scores key j of the tile against the warp's
// rows (its key row read once per four columns, the rows' columns broadcast), the row's
// maximum and the probabilities' shift take the warp's shuffles, and each probability goes
// to the lanes by a shuffle for P V, lane c holding the output columns c CW .. c CW + CW - 1.
// A decode reads each K and V byte once with a few fma a byte: its speed is the bytes in
// flight.

// Where the rows of a float32 decode block's (batch, key head) live (as attention.cu's
// SkDenseKeys / SkPagedKeys): at(b, kh) gives the rows of one, whose load copies ROWS key
// rows and the value rows beside them from key position n into shared rows of D + 4 floats,
// zero-filling rows at or past `valid`.
template <int D>
struct SkF32DenseRows {
    const float* kb;
    const float* vb;
    long long k_sl, v_sl;
    template <int ROWS, int THREADS>
    __device__ __forceinline__ void load(float* k_smem, float* v_smem, long long n,
                                         int valid) const {
        sk_load_padded<ROWS, D, THREADS>(k_smem, kb + n * k_sl, k_sl, valid);
        sk_load_padded<ROWS, D, THREADS>(v_smem, vb + n * v_sl, v_sl, valid);
    }
};
template <int D>
struct SkF32DenseKeys {
    const float* k;
    const float* v;
    long long k_sb, k_sh, k_sl, v_sb, v_sh, v_sl;
    __device__ __forceinline__ SkF32DenseRows<D> at(int b, int kh) const {
        return {k + b * k_sb + kh * k_sh, v + b * v_sb + kh * v_sh, k_sl, v_sl};
    }
};

// Paged: key position p of sequence b is row p % S of page pages[p / S] (p / S one
// multiply-high by the host's magic), k and v at the key head's rows of page 0, the body's
// key n the sequence's key first + n; a row at or past `valid` reads neither the table nor
// the pool, and a key row and its value row share one lookup.
template <int D>
struct SkF32PagedRows {
    const float* k;
    const float* v;
    const int* pages;
    long long k_sp, k_sl, v_sp, v_sl;
    unsigned page_mul;
    int page_shift, page_size, first;
    template <int ROWS, int THREADS>
    __device__ __forceinline__ void load(float* k_smem, float* v_smem, long long n,
                                         int valid) const {
        // THREADS / ROWS threads a row: one page lookup a thread, then its share of the
        // row's 16-byte chunks
        constexpr int CHUNKS = D / 4, TPR = THREADS / ROWS;
        static_assert(THREADS % ROWS == 0 && CHUNKS % TPR == 0, "whole rows and chunks");
        const int r = threadIdx.x / TPR;
        const bool ok = r < valid;
        const int p = first + static_cast<int>(n) + (ok ? r : 0);
        const int at = static_cast<int>(
            (static_cast<unsigned long long>(static_cast<unsigned>(p)) * page_mul) >>
            page_shift);
        const long long pg = __ldg(pages + at), sl = p - at * page_size;
        const float* kr = k + pg * k_sp + sl * k_sl;
        const float* vr = v + pg * v_sp + sl * v_sl;
#pragma unroll
        for (int ch = threadIdx.x % TPR; ch < CHUNKS; ch += TPR) {
            sk_cp_async16(k_smem + r * (D + 4) + ch * 4, kr + ch * 4, ok);
            sk_cp_async16(v_smem + r * (D + 4) + ch * 4, vr + ch * 4, ok);
        }
    }
};
template <int D>
struct SkF32PagedKeys {
    const float* k_pages;
    const float* v_pages;
    const int* block_table;
    long long k_sp, k_sh, k_sl, v_sp, v_sh, v_sl, t_sb;
    unsigned page_mul;
    int page_shift, page_size, first;
    __device__ __forceinline__ SkF32PagedRows<D> at(int b, int kh) const {
        return {k_pages + kh * k_sh, v_pages + kh * v_sh, block_table + b * t_sb, k_sp, k_sl,
                v_sp, v_sl, page_mul, page_shift, page_size, first};
    }
};

template <int D, int WARPS, int STAGES, typename Keys>
__device__ __forceinline__ void sk_attn_decode_f32_body(
    const float* __restrict__ q, const Keys& keys, const unsigned* __restrict__ mask,
    float* __restrict__ part_out, float* __restrict__ part_lse, long long q_sb,
    long long q_sh, long long q_sl, long long m_sb, long long m_sh, long long m_sq,
    int hq, int hk, int lq, int lk, int chunk, float scale, float softcap,
    int offset, int causal, int left, int right) {
    static_assert(STAGES >= 2, "a tile in flight while one is read");
    static_assert(D % 32 == 0 && 16 % WARPS == 0, "whole columns a lane, whole rows a warp");
    constexpr int BN = 32;           // keys a tile: one a lane
    constexpr int W = D + 4;         // row width in shared memory
    constexpr int RW = 16 / WARPS;   // query rows a warp
    constexpr int CW = D / 32;       // output columns a lane
    constexpr int THREADS = WARPS * 32;
    extern __shared__ __align__(16) unsigned char sk_smem[];
    float* sq = reinterpret_cast<float*>(sk_smem);  // 16 query rows
    float* sk = sq + 16 * W;          // STAGES tiles of keys
    float* sv = sk + STAGES * BN * W; // STAGES tiles of values

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int split = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
    const int group = hq / hk;
    const int rows = group * lq;  // <= 16
    const auto kv = keys.at(b, kh);

    // Q rows: row r is query head kh * group + r / lq, query r % lq
    for (int c = threadIdx.x; c < 16 * (D / 4); c += THREADS) {
        const int r = c / (D / 4), ch = c % (D / 4);
        const bool ok = r < rows;
        const int h = kh * group + (ok ? r / lq : 0), i = ok ? r % lq : 0;
        sk_cp_async16(sq + r * W + ch * 4, q + b * q_sb + h * q_sh + i * q_sl + ch * 4, ok);
    }
    const int n_begin = split * chunk, n_end = min(lk, n_begin + chunk);
    const int tiles = n_end > n_begin ? (n_end - n_begin + BN - 1) / BN : 0;
    auto issue = [&](int i, int s) {  // one commit group a tile, empty past the last
        if (i < tiles) {
            const int n0 = n_begin + i * BN;
            kv.template load<BN, THREADS>(sk + s * BN * W, sv + s * BN * W, n0, n_end - n0);
        }
        sk_cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s, s);  // Q rides in tile 0's group

    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    float acc[RW][CW], row_max[RW], row_sum[RW];  // row_sum: this lane's keys' share
    int row_head[RW], row_query[RW];  // the row's query head and query
#pragma unroll
    for (int i = 0; i < RW; ++i) {
#pragma unroll
        for (int c = 0; c < CW; ++c) acc[i][c] = 0.0f;
        row_max[i] = -SK_INF;
        row_sum[i] = 0.0f;
        const int r = min(warp + WARPS * i, rows - 1);
        row_head[i] = kh * group + r / lq;
        row_query[i] = r % lq;
    }
    int stage = 0;
    for (int tile = 0; tile < tiles; ++tile) {
        // this tile landed, and every warp is done with the last one, whose stage the issue
        // below refills
        sk_cp_async_wait<STAGES - 2>();
        __syncthreads();
        issue(tile + STAGES - 1, stage == 0 ? STAGES - 1 : stage - 1);
        const float* ks = sk + stage * BN * W;
        const float* vs = sv + stage * BN * W;
        const int j = n_begin + tile * BN + lane;  // this lane's key

        // scores of the lane's key against the warp's rows: its key row read once per four
        // columns, the rows' columns broadcast
        float s[RW];
#pragma unroll
        for (int i = 0; i < RW; ++i) s[i] = 0.0f;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            const float4 kv4 = *reinterpret_cast<const float4*>(ks + lane * W + d);
#pragma unroll
            for (int i = 0; i < RW; ++i) {
                if (warp + WARPS * i < rows) {
                    const float4 q4 =
                        *reinterpret_cast<const float4*>(sq + (warp + WARPS * i) * W + d);
                    s[i] = fmaf(q4.x, kv4.x, s[i]);
                    s[i] = fmaf(q4.y, kv4.y, s[i]);
                    s[i] = fmaf(q4.z, kv4.z, s[i]);
                    s[i] = fmaf(q4.w, kv4.w, s[i]);
                }
            }
        }
        // the online softmax of each of the warp's rows (uniform branches: a row past
        // `rows` is skipped by the whole warp)
        float p[RW];
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            const int r = warp + WARPS * i;
            p[i] = 0.0f;
            if (r < rows) {
                float x = s[i] * qk_scale;
                if (softcap > 0.0f) x = sk_softcap_log2(x, softcap, inv_cap);
                const int diag = row_query[i] + offset;
                bool ok = j < n_end && (!causal || j <= diag) &&
                          (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right);
                if (ok && mask) {
                    ok = (mask[b * m_sb + row_head[i] * m_sh + row_query[i] * m_sq + (j >> 5)] >>
                          (j & 31)) & 1u;
                }
                x = ok ? x : -SK_INF;
                float mx = fmaxf(row_max[i], x);
#pragma unroll
                for (int o = 16; o > 0; o /= 2) {
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                }
                const float use = mx == -SK_INF ? 0.0f : mx;  // nothing allowed yet: p = 0
                const float rescale = sk_ex2(row_max[i] - use);
                row_max[i] = mx;
                p[i] = sk_ex2(x - use);
                row_sum[i] = row_sum[i] * rescale + p[i];
#pragma unroll
                for (int c = 0; c < CW; ++c) acc[i][c] *= rescale;
            }
        }
        // P V: key n's value columns read once, its probabilities from lane n by shuffles
#pragma unroll 4
        for (int n = 0; n < BN; ++n) {
            float vr[CW];
            sk_f32_load_run<CW>(vr, vs + n * W + lane * CW);
#pragma unroll
            for (int i = 0; i < RW; ++i) {
                if (warp + WARPS * i < rows) {
                    const float pn = __shfl_sync(0xffffffffu, p[i], n);
#pragma unroll
                    for (int c = 0; c < CW; ++c) acc[i][c] = fmaf(pn, vr[c], acc[i][c]);
                }
            }
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
    sk_cp_async_wait<0>();

    // the warp's rows: their sums over the lanes, normalized, into the split's partial state
    const long long total_rows = static_cast<long long>(gridDim.z) * hq * lq;
#pragma unroll
    for (int i = 0; i < RW; ++i) {
        const int r = warp + WARPS * i;
        if (r >= rows) continue;
        float l = row_sum[i];
#pragma unroll
        for (int o = 16; o > 0; o /= 2) l += __shfl_xor_sync(0xffffffffu, l, o);
        const int h = kh * group + r / lq, qi = r % lq;
        const long long at = split * total_rows + (static_cast<long long>(b) * hq + h) * lq + qi;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int c = 0; c < CW; ++c) part_out[at * D + lane * CW + c] = acc[i][c] * inv;
        if (lane == 0) part_lse[at] = l > 0.0f ? (row_max[i] + log2f(l)) * SK_LN2 : -SK_INF;
    }
}

// Dense float32 decoding: the parameters of sk_attn_decode (kernels/attention.cu).  The launch
// bounds ask for one block a multiprocessor at least, so that ptxas takes the registers the
// rows need rather than spill (with no minimum it spilled a few bytes at some head dims).
template <int D, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, 1) sk_attn_decode_f32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const unsigned* __restrict__ mask, float* __restrict__ part_out,
    float* __restrict__ part_lse, long long q_sb, long long q_sh, long long q_sl,
    long long k_sb, long long k_sh, long long k_sl, long long v_sb, long long v_sh,
    long long v_sl, long long m_sb, long long m_sh, long long m_sq, int hq,
    int hk, int lq, int lk, int chunk, float scale, float softcap, int offset, int causal,
    int left, int right) {
    const SkF32DenseKeys<D> keys{k, v, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl};
    sk_attn_decode_f32_body<D, WARPS, STAGES>(q, keys, mask, part_out, part_lse, q_sb, q_sh,
                                               q_sl, m_sb, m_sh, m_sq, hq, hk, lq, lk, chunk,
                                               scale, softcap, offset, causal, left, right);
}

// Paged float32 decoding: the parameters and the window's first key of sk_attn_decode_paged
// (kernels/attention.cu).
template <int D, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, 1) sk_attn_decode_f32_paged(
    const float* __restrict__ q, const float* __restrict__ k_pages,
    const float* __restrict__ v_pages, const int* __restrict__ block_table,
    const int* __restrict__ seqlens, float* __restrict__ part_out,
    float* __restrict__ part_lse, long long q_sb, long long q_sh, long long q_sl,
    long long k_sp, long long k_sh, long long k_sl, long long v_sp, long long v_sh,
    long long v_sl, long long t_sb, int page_size, unsigned page_mul, int page_shift, int hq,
    int hk, int lq, int chunk, float scale, float softcap, int causal, int left, int right) {
    const int len = __ldg(seqlens + blockIdx.z);
    const long long lo = static_cast<long long>(len) - lq - left;  // no int overflow
    const int first = left >= 0 && lo > 0 ? static_cast<int>(lo) : 0;
    const SkF32PagedKeys<D> keys{k_pages, v_pages, block_table, k_sp, k_sh, k_sl, v_sp, v_sh,
                                 v_sl, t_sb, page_mul, page_shift, page_size, first};
    sk_attn_decode_f32_body<D, WARPS, STAGES>(q, keys, nullptr, part_out, part_lse, q_sb, q_sh,
                                               q_sl, 0, 0, 0, hq, hk, lq, len - first, chunk,
                                               scale, softcap, len - lq - first, causal, left,
                                               right);
}
