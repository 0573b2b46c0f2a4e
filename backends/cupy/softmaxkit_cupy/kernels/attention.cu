// Attention forward on tensor cores: online softmax over key tiles (FlashAttention-2 order).
//
// One block computes BM = 16 * WARPS query rows of one (batch, head); each warp owns 16 rows,
// holds its Q fragments, the score tile S = Q K^T and the output accumulator in registers
// (float32).  K and V tiles of BN keys stream through double-buffered shared memory with
// cp.async; the probabilities P are converted to 16-bit in registers and reused as the A
// operand of O += P V.  Scores are kept in log2 units (scale * log2 e folded in) so each
// probability costs one ex2.  Excluded keys (causal, window, boolean mask, past Lk) score
// -inf; a row whose running maximum is still -inf keeps O = 0, l = 0, and ends as out 0,
// lse -inf (spec "Attention": a row with no allowed key).
#include "mma.cuh"
#include "exclusion.cuh"

#define SK_LN2 0.6931471805599453f
#define SK_LOG2E 1.4426950408889634f

// The forward's body, for two layouts chosen at compile time.  Dense (VARLEN = false):
// q [B, Hq, Lq, D] and k, v [B, Hk, Lk, D] by element strides, out [B, Hq, Lq, D] and lse [B, Hq, Lq]
// contiguous.  Packed variable-length (VARLEN = true, spec "Packed variable-length
// attention"): q [Tq, Hq, D], k, v [Tk, Hk, D] by token and head strides, out [Tq, Hq, D] and
// lse [Tq, Hq] contiguous; block z is sequence b, whose queries are the tokens
// cu_q[b] .. cu_q[b + 1] and keys cu_k[b] .. cu_k[b + 1]; lq, lk and the causal offset are
// the sequence's own (``offset`` is then 1 for bottom-right alignment, 0 for top-left) and
// the blocks past its last query tile return at once.  The dense code path is the one
// sk_attn_fwd had before the packed variant, so the dense kernels compile to the same PTX.
template <typename T, int D, int WARPS, int BN, int MT, bool MASK, bool VARLEN>
__device__ __forceinline__ void sk_attn_fwd_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const unsigned* __restrict__ mask, T* __restrict__ out, float* __restrict__ lse,
    const long long* __restrict__ cu_q, const long long* __restrict__ cu_k,
    long long q_sb, long long q_sh, long long q_sl, long long k_sb, long long k_sh,
    long long k_sl, long long v_sb, long long v_sh, long long v_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    float scale, float softcap, int offset, int causal, int left, int right) {
    // each warp owns MT m16 tiles (16 MT rows), so every K / V fragment read from shared
    // memory feeds MT tensor-core products; Q fragments are re-read per tile (registers go
    // to the output accumulator).  MASK = false builds a kernel without the boolean mask's
    // code (its loads cost registers the larger tiles need); the caller passes no mask then.
    constexpr int BM = 16 * MT * WARPS;
    constexpr int THREADS = WARPS * 32;
    constexpr int NB = BN / 8;   // n-blocks of the score tile
    constexpr int DB = D / 8;    // n-blocks of the output
    constexpr int DK = D / 16;   // k-slices of the head dimension
    typedef SkMma<T> Mma;
    extern __shared__ __align__(16) unsigned char sk_smem[];
    T* sq = reinterpret_cast<T*>(sk_smem);
    T* sk = sq + BM * D;       // 2 stages
    T* sv = sk + 2 * BN * D;   // 2 stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // the last query blocks (the most keys under causal masks) start first
    int m0 = VARLEN ? 0 : (gridDim.x - 1 - blockIdx.x) * BM;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kh = h / (hq / hk);
    const T *qb, *kb, *vb;
    if constexpr (VARLEN) {
        const long long q_tok = cu_q[b], k_tok = cu_k[b];
        lq = static_cast<int>(cu_q[b + 1] - q_tok);
        lk = static_cast<int>(cu_k[b + 1] - k_tok);
        offset = offset ? lk - lq : 0;
        // the grid covers the longest sequence; the last blocks of this one start first
        const int blocks = (lq + BM - 1) / BM;
        if (static_cast<int>(blockIdx.x) >= blocks) return;
        m0 = (blocks - 1 - blockIdx.x) * BM;
        qb = q + (q_tok + m0) * q_sl + h * q_sh;
        kb = k + k_tok * k_sl + kh * k_sh;
        vb = v + k_tok * v_sl + kh * v_sh;
        // the sequence's rows of out [Tq, Hq, D] and lse [Tq, Hq]
        out += q_tok * hq * D;
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
        sk_load_tile<T, BM, D, THREADS>(sq, qb, q_sl, lq - m0);
        sk_load_tile<T, BN, D, THREADS>(sk, kb + tile_lo * BN * k_sl, k_sl, lk - tile_lo * BN);
        sk_cp_async_commit();
        sk_load_tile<T, BN, D, THREADS>(sv, vb + tile_lo * BN * v_sl, v_sl, lk - tile_lo * BN);
        sk_cp_async_commit();
    }
    const int w0 = warp * 16 * MT;  // this warp's first row in the block

    for (int tile = tile_lo; tile < tile_hi; ++tile) {
        const int stage = (tile - tile_lo) & 1;
        const int n0 = tile * BN;
        sk_cp_async_wait<1>();  // this tile's K (and, the first time, Q) has landed
        __syncthreads();
        if (tile + 1 < tile_hi) {
            sk_load_tile<T, BN, D, THREADS>(sk + (stage ^ 1) * BN * D, kb + (n0 + BN) * k_sl,
                                            k_sl, lk - n0 - BN);
        }
        sk_cp_async_commit();

        float s[MT][NB][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < NB; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
        const T* ks = sk + stage * BN * D;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            unsigned qf[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) sk_frag<SK_A, D>(qf[mt], sq, w0 + 16 * mt, kk * 16);
#pragma unroll
            for (int nb = 0; nb < NB; nb += 2) {
                unsigned bf[4];
                sk_frag<SK_B, D>(bf, ks, nb * 8, kk * 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    sk_mma_pair<T>(s[mt][nb], s[mt][nb + 1], qf[mt], bf);
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
            sk_load_tile<T, BN, D, THREADS>(sv + (stage ^ 1) * BN * D, vb + (n0 + BN) * v_sl,
                                            v_sl, lk - n0 - BN);
        }
        sk_cp_async_commit();

        const T* vs = sv + stage * BN * D;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                sk_pack_a<T>(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
            }
#pragma unroll
            for (int db = 0; db < DB; db += 2) {
                unsigned bf[4];
                sk_frag<SK_BT, D>(bf, vs, kk * 16, db * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    sk_mma_pair<T>(o[mt][db], o[mt][db + 1], pa[mt], bf);
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
                // the output row and its lse slot: [B, Hq, Lq] rows, or [Tq, Hq] when packed
                const long long row = VARLEN
                                          ? static_cast<long long>(i) * hq + h
                                          : (static_cast<long long>(b) * hq + h) * lq + i;
                T* orow = out + row * D;
#pragma unroll
                for (int db = 0; db < DB; ++db) {
                    const unsigned packed =
                        Mma::pack(o[mt][db][2 * r] * inv, o[mt][db][2 * r + 1] * inv);
                    *reinterpret_cast<unsigned*>(orow + db * 8 + 2 * t) = packed;
                }
                if (lse && t == 0) {
                    lse[row] = l > 0.0f ? (row_max[mt][r] + log2f(l)) * SK_LN2 : -SK_INF;
                }
            }
        }
    }
}

template <typename T, int D, int WARPS, int BN, int MT, bool MASK>
__global__ void __launch_bounds__(WARPS * 32) sk_attn_fwd(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const unsigned* __restrict__ mask, T* __restrict__ out, float* __restrict__ lse,
    long long q_sb, long long q_sh, long long q_sl, long long k_sb, long long k_sh,
    long long k_sl, long long v_sb, long long v_sh, long long v_sl, long long m_sb,
    long long m_sh, long long m_sq, int hq, int hk, int lq, int lk,
    float scale, float softcap, int offset, int causal, int left, int right) {
    sk_attn_fwd_body<T, D, WARPS, BN, MT, MASK, false>(
        q, k, v, mask, out, lse, nullptr, nullptr, q_sb, q_sh, q_sl, k_sb, k_sh, k_sl, v_sb,
        v_sh, v_sl, m_sb, m_sh, m_sq, hq, hk, lq, lk, scale, softcap, offset, causal,
        left, right);
}

// Packed variable-length forward: grid (query tiles of the longest sequence, Hq, B); q, k, v
// by token and head strides (elements), cu_q, cu_k int64 [B + 1]; bottom_right 1 aligns the
// causal diagonal and the window to each sequence's last key, 0 to its first.
template <typename T, int D, int WARPS, int BN, int MT>
__global__ void __launch_bounds__(WARPS * 32) sk_attn_fwd_varlen(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const long long* __restrict__ cu_q, const long long* __restrict__ cu_k,
    T* __restrict__ out, float* __restrict__ lse, long long q_st, long long q_sh,
    long long k_st, long long k_sh, long long v_st, long long v_sh, int hq, int hk,
    float scale, float softcap, int bottom_right, int causal, int left, int right) {
    sk_attn_fwd_body<T, D, WARPS, BN, MT, false, true>(
        q, k, v, nullptr, out, lse, cu_q, cu_k, 0, q_sh, q_st, 0, k_sh, k_st, 0, v_sh, v_st,
        0, 0, 0, hq, hk, 0, 0, scale, softcap, bottom_right, causal, left, right);
}

// The data path of the forward alone, for checking fragments on a new device: one block of
// four warps computes S = Q K^T (64 x 64, float) and O = P V with P = S rounded to T.
template <typename T>
__global__ void __launch_bounds__(128) sk_mma_probe(const T* q, const T* k, const T* v,
                                                    float* s_out, float* o_out) {
    constexpr int D = 128, BN = 64;
    __shared__ __align__(16) T sq[64 * D];
    __shared__ __align__(16) T sk[BN * D];
    __shared__ __align__(16) T sv[BN * D];
    sk_load_tile<T, 64, D, 128>(sq, q, D, 64);
    sk_load_tile<T, BN, D, 128>(sk, k, D, BN);
    sk_load_tile<T, BN, D, 128>(sv, v, D, BN);
    sk_cp_async_commit();
    sk_cp_async_wait<0>();
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float s[BN / 8][4] = {};
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[4];
        sk_frag<SK_A, D>(a, sq, warp * 16, kk * 16);
        for (int nb = 0; nb < BN / 8; nb += 2) {
            unsigned bf[4];
            sk_frag<SK_B, D>(bf, sk, nb * 8, kk * 16);
            sk_mma_pair<T>(s[nb], s[nb + 1], a, bf);
        }
    }
    float o[D / 8][4] = {};
    for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned pa[4];
        sk_pack_a<T>(pa, s[2 * kk], s[2 * kk + 1]);
        for (int db = 0; db < D / 8; db += 2) {
            unsigned bf[4];
            sk_frag<SK_BT, D>(bf, sv, kk * 16, db * 8);
            sk_mma_pair<T>(o[db], o[db + 1], pa, bf);
        }
    }
    const int r = warp * 16 + g;
    for (int nb = 0; nb < BN / 8; ++nb)
        for (int e = 0; e < 4; ++e)
            s_out[(r + (e / 2) * 8) * BN + nb * 8 + 2 * t + (e & 1)] = s[nb][e];
    for (int db = 0; db < D / 8; ++db)
        for (int e = 0; e < 4; ++e)
            o_out[(r + (e / 2) * 8) * D + db * 8 + 2 * t + (e & 1)] = o[db][e];
}

// Where the key and value rows of the split-KV decode body's (batch, key head) live: at(b, kh)
// gives the rows of one, whose load copies ROWS key rows and the value rows beside them from
// key position n into swizzled shared tiles, zero-filling rows at or past `valid` (n is
// widened at the call, as the dense row offset always was).  Dense: k, v [B, Hk, Lk, D] by
// element strides, rows at a fixed stride.
template <typename T, int D>
struct SkDenseRows {
    const T* kb;
    const T* vb;
    long long k_sl, v_sl;
    template <int ROWS, int THREADS>
    __device__ __forceinline__ void load(T* k_smem, T* v_smem, long long n, int valid) const {
        sk_load_tile<T, ROWS, D, THREADS>(k_smem, kb + n * k_sl, k_sl, valid);
        sk_load_tile<T, ROWS, D, THREADS>(v_smem, vb + n * v_sl, v_sl, valid);
    }
};
template <typename T, int D>
struct SkDenseKeys {
    const T* k;
    const T* v;
    long long k_sb, k_sh, k_sl, v_sb, v_sh, v_sl;
    __device__ __forceinline__ SkDenseRows<T, D> at(int b, int kh) const {
        return {k + b * k_sb + kh * k_sh, v + b * v_sb + kh * v_sh, k_sl, v_sl};
    }
};

// Paged (spec "Paged attention"): key position p of sequence b is row p % S of page
// pages[p / S], pages being row b of the block table; k and v point at the key head's rows
// of page 0, and the body's key n is the sequence's key first + n.  p / S is one
// multiply-high by a host-computed magic (mul, shift), S being a runtime value.  A row at or
// past `valid` reads neither the block table nor the pool (its address is the tile's first
// row's, and cp.async copies 0 bytes from it).  A key row and its value row share a page
// and a slot: one lookup serves both copies.
template <typename T, int D>
struct SkPagedRows {
    const T* k;
    const T* v;
    const int* pages;
    long long k_sp, k_sl, v_sp, v_sl;
    unsigned page_mul;
    int page_shift, page_size;
    int first;  // the sequence's key position of the body's key 0
    template <int ROWS, int THREADS>
    __device__ __forceinline__ void load(T* k_smem, T* v_smem, long long n, int valid) const {
        constexpr int CHUNKS = D / 8, STEPS = ROWS * CHUNKS / THREADS;
        static_assert(ROWS * CHUNKS % THREADS == 0, "whole steps of the tile's chunks");
        // every page index of the thread's rows first, then the copies: the loads are
        // independent, so their latencies overlap (cp.async's memory clobber would
        // otherwise order each one after the previous copy)
        int page[STEPS], slot[STEPS];
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const int r = (threadIdx.x + i * THREADS) / CHUNKS;
            const int p = first + static_cast<int>(n) + (r < valid ? r : 0);
            const int at = static_cast<int>(
                (static_cast<unsigned long long>(static_cast<unsigned>(p)) * page_mul) >>
                page_shift);
            slot[i] = p - at * page_size;
            page[i] = __ldg(pages + at);
        }
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const int c = threadIdx.x + i * THREADS;
            const int r = c / CHUNKS, ch = c % CHUNKS;
            const int at = sk_swz<D>(r, ch * 8);
            const long long pg = page[i], sl = slot[i];
            sk_cp_async16(k_smem + at, k + pg * k_sp + sl * k_sl + ch * 8, r < valid);
            sk_cp_async16(v_smem + at, v + pg * v_sp + sl * v_sl + ch * 8, r < valid);
        }
    }
};
template <typename T, int D>
struct SkPagedKeys {
    const T* k_pages;
    const T* v_pages;
    const int* block_table;
    long long k_sp, k_sh, k_sl, v_sp, v_sh, v_sl, t_sb;
    unsigned page_mul;
    int page_shift, page_size, first;
    __device__ __forceinline__ SkPagedRows<T, D> at(int b, int kh) const {
        return {k_pages + kh * k_sh, v_pages + kh * v_sh, block_table + b * t_sb, k_sp, k_sl,
                v_sp, v_sl, page_mul, page_shift, page_size, first};
    }
};

// Split-KV decoding: few query rows (G query heads sharing one key head, times Lq, at most
// 16 rows: one m16 tile), many keys.  Block (split, key head, batch) walks its share of the
// keys in tiles of 16 * WARPS; warp w takes keys [16 w, 16 w + 16) of each tile and keeps its
// own running summary (max, sum, numerator); the warps merge in shared memory and the block
// writes a partial (out, lse) in float32, merged over the splits by sk_merge_attn.  Keys
// says where the rows of the block's (batch, key head) live (SkDenseKeys, SkPagedKeys); lk
// and offset (the causal diagonal of query 0) are the sequence's.  Decoding is a stream of K
// and V with little arithmetic, so its speed is the bytes in flight: K and V tiles sit in a
// ring of STAGES stages, tile t + STAGES - 1 issued as tile t starts, STAGES - 1 tiles of
// both in flight while one is read, one barrier a tile.
template <typename T, int D, int WARPS, int STAGES, typename Keys>
__device__ __forceinline__ void sk_attn_decode_body(
    const T* __restrict__ q, const Keys& keys, const unsigned* __restrict__ mask,
    float* __restrict__ part_out, float* __restrict__ part_lse, long long q_sb,
    long long q_sh, long long q_sl, long long m_sb, long long m_sh, long long m_sq,
    int hq, int hk, int lq, int lk, int chunk, float scale, float softcap,
    int offset, int causal, int left, int right) {
    static_assert(STAGES >= 2, "a tile in flight while one is read");
    constexpr int BN = 16 * WARPS;
    constexpr int THREADS = WARPS * 32;
    constexpr int DB = D / 8, DK = D / 16;
    extern __shared__ __align__(16) unsigned char sk_smem[];
    T* sq = reinterpret_cast<T*>(sk_smem);
    T* sk = sq + 16 * D;           // STAGES tiles of keys
    T* sv = sk + STAGES * BN * D;  // STAGES tiles of values

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int split = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
    const int group = hq / hk;
    const int rows = group * lq;  // <= 16
    const auto kv = keys.at(b, kh);

    // Q rows: row r is query head kh * group + r / lq, query r % lq
    for (int c = threadIdx.x; c < 16 * (D / 8); c += THREADS) {
        const int r = c / (D / 8), ch = c % (D / 8);
        const bool ok = r < rows;
        const int h = kh * group + (ok ? r / lq : 0), i = ok ? r % lq : 0;
        sk_cp_async16(sq + sk_swz<D>(r, ch * 8), q + b * q_sb + h * q_sh + i * q_sl + ch * 8, ok);
    }
    const int n_begin = split * chunk, n_end = min(lk, n_begin + chunk);
    const int tiles = n_end > n_begin ? (n_end - n_begin + BN - 1) / BN : 0;
    // K and V of tile i into stage s, one commit group (empty past the last tile, so that
    // every wait below names the same count)
    auto issue = [&](int i, int s) {
        if (i < tiles) {
            const int n0 = n_begin + i * BN;
            kv.template load<BN, THREADS>(sk + s * BN * D, sv + s * BN * D, n0, n_end - n0);
        }
        sk_cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s, s);  // Q rides in tile 0's group

    const float qk_scale = softcap > 0.0f ? scale : scale * SK_LOG2E;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    float o[DB][4];
#pragma unroll
    for (int i = 0; i < DB; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float row_max[2] = {-SK_INF, -SK_INF};
    float row_sum[2] = {0.0f, 0.0f};
    // Q's fragments stay in registers up to D = 128; wider rows re-read them from shared
    // memory each tile (D / 4 more registers would spill the output accumulators)
    constexpr bool HOLD_Q = D <= 128;
    unsigned qf[HOLD_Q ? DK : 1][4];
    sk_cp_async_wait<STAGES - 2>();
    __syncthreads();
    if constexpr (HOLD_Q) {
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) sk_frag<SK_A, D>(qf[kk], sq, 0, kk * 16);
    }

    int stage = 0;  // the stage of this tile; the next issue goes to the one before it
    for (int tile = 0; tile < tiles; ++tile) {
        const int n0 = n_begin + tile * BN;
        if (tile > 0) {
            // this tile landed, and every warp is done with the last one, whose stage the
            // issue below refills
            sk_cp_async_wait<STAGES - 2>();
            __syncthreads();
        }
        issue(tile + STAGES - 1, stage == 0 ? STAGES - 1 : stage - 1);
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        const T* ks = sk + stage * BN * D;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            unsigned bf[4];
            sk_frag<SK_B, D>(bf, ks, warp * 16, kk * 16);
            if constexpr (HOLD_Q) {
                sk_mma_pair<T>(s[0], s[1], qf[kk], bf);
            } else {
                sk_frag<SK_A, D>(qf[0], sq, 0, kk * 16);
                sk_mma_pair<T>(s[0], s[1], qf[0], bf);
            }
        }
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[nb][e] * qk_scale;
                if (softcap > 0.0f) x = sk_softcap_log2(x, softcap, inv_cap);
                const int r = g + (e >= 2 ? 8 : 0);
                const int h = kh * group + (r < rows ? r / lq : 0), i = r < rows ? r % lq : 0;
                const int j = n0 + warp * 16 + nb * 8 + 2 * t + (e & 1);
                const int d = i + offset;
                bool ok = r < rows && j < n_end && (!causal || j <= d) &&
                          (left < 0 || j >= d - left) && (right < 0 || j <= d + right);
                if (ok && mask) ok = (mask[b * m_sb + h * m_sh + i * m_sq + (j >> 5)] >> (j & 31)) & 1u;
                s[nb][e] = ok ? x : -SK_INF;
            }
        }
        float scale_old[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = fmaxf(row_max[r], fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]),
                                               fmaxf(s[1][2 * r], s[1][2 * r + 1])));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float use = mx == -SK_INF ? 0.0f : mx;
            scale_old[r] = exp2f(row_max[r] - use);
            row_max[r] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int nb = 0; nb < 2; ++nb) {
                s[nb][2 * r] = exp2f(s[nb][2 * r] - use);
                s[nb][2 * r + 1] = exp2f(s[nb][2 * r + 1] - use);
                sum += s[nb][2 * r] + s[nb][2 * r + 1];
            }
            row_sum[r] = row_sum[r] * scale_old[r] + sum;
        }
#pragma unroll
        for (int i = 0; i < DB; ++i) sk_scale_rows(o[i], scale_old);
        const T* vs = sv + stage * BN * D;
        unsigned pa[4];
        sk_pack_a<T>(pa, s[0], s[1]);
#pragma unroll
        for (int db = 0; db < DB; db += 2) {
            unsigned bf[4];
            sk_frag<SK_BT, D>(bf, vs, warp * 16, db * 8);
            sk_mma_pair<T>(o[db], o[db + 1], pa, bf);
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
    sk_cp_async_wait<0>();
    __syncthreads();

    // merge the warps' summaries: shared memory is free now
    float* red_m = reinterpret_cast<float*>(sk_smem);  // [WARPS][16]
    float* red_l = red_m + WARPS * 16;                  // [WARPS][16]
    float* red_o = red_l + WARPS * 16;                  // [WARPS][16][D]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int row = g + 8 * r;
        if (t == 0) {
            red_m[warp * 16 + row] = row_max[r];
            red_l[warp * 16 + row] = l;
        }
#pragma unroll
        for (int db = 0; db < DB; ++db) {
            red_o[(warp * 16 + row) * D + db * 8 + 2 * t] = o[db][2 * r];
            red_o[(warp * 16 + row) * D + db * 8 + 2 * t + 1] = o[db][2 * r + 1];
        }
    }
    __syncthreads();
    const int splits = gridDim.x;
    for (int c = threadIdx.x; c < rows * D; c += THREADS) {
        const int row = c / D, col = c % D;
        float m = -SK_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, red_m[w * 16 + row]);
        const float use = m == -SK_INF ? 0.0f : m;
        float l = 0.0f, acc = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = exp2f(red_m[w * 16 + row] - use);
            l += red_l[w * 16 + row] * f;
            acc += red_o[(w * 16 + row) * D + col] * f;
        }
        const int h = kh * group + row / lq, i = row % lq;
        const long long r_out = (static_cast<long long>(b) * hq + h) * lq + i;
        const long long total_rows = static_cast<long long>(gridDim.z) * hq * lq;
        part_out[(split * total_rows + r_out) * D + col] = l > 0.0f ? acc / l : 0.0f;
        if (col == 0) {
            part_lse[split * total_rows + r_out] =
                l > 0.0f ? (m + log2f(l)) * SK_LN2 : -SK_INF;
        }
    }
    (void)splits;
}

template <typename T, int D, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) sk_attn_decode(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const unsigned* __restrict__ mask, float* __restrict__ part_out,
    float* __restrict__ part_lse, long long q_sb, long long q_sh, long long q_sl,
    long long k_sb, long long k_sh, long long k_sl, long long v_sb, long long v_sh,
    long long v_sl, long long m_sb, long long m_sh, long long m_sq, int hq,
    int hk, int lq, int lk, int chunk, float scale, float softcap, int offset, int causal,
    int left, int right) {
    const SkDenseKeys<T, D> keys{k, v, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl};
    sk_attn_decode_body<T, D, WARPS, STAGES>(q, keys, mask, part_out, part_lse, q_sb, q_sh, q_sl,
                                     m_sb, m_sh, m_sq, hq, hk, lq, lk, chunk, scale,
                                     softcap, offset, causal, left, right);
}

// Split-KV decoding against a paged KV cache (spec "Paged attention"): grid (splits, Hk, B)
// as for sk_attn_decode, with split s taking keys [s * chunk, (s + 1) * chunk) of the
// sequence; k_pages [P, Hk, S, D] and v_pages [P, Hk, S, D] by page, head and row strides
// (elements), block_table int32 [B, max_pages] with row stride t_sb, seqlens int32 [B].
// Sequence b has seqlens[b] keys and its queries sit on the last Lq positions
// (bottom-right); a split past its end writes an empty partial state (out 0, lse -inf).
// With a left window bound the keys before the first query's window, which no query sees,
// are left out: the body walks keys [first, seqlens[b]) as its keys 0.., its causal
// diagonal and window shifted by first (the same exclusions), so a sliding window over a
// long cache reads only the window and the grid need span no more than left + Lq keys.
template <typename T, int D, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) sk_attn_decode_paged(
    const T* __restrict__ q, const T* __restrict__ k_pages, const T* __restrict__ v_pages,
    const int* __restrict__ block_table, const int* __restrict__ seqlens,
    float* __restrict__ part_out, float* __restrict__ part_lse, long long q_sb,
    long long q_sh, long long q_sl, long long k_sp, long long k_sh, long long k_sl,
    long long v_sp, long long v_sh, long long v_sl, long long t_sb, int page_size,
    unsigned page_mul, int page_shift, int hq, int hk, int lq, int chunk, float scale,
    float softcap, int causal, int left, int right) {
    const int len = __ldg(seqlens + blockIdx.z);
    const long long lo = static_cast<long long>(len) - lq - left;  // no int overflow
    const int first = left >= 0 && lo > 0 ? static_cast<int>(lo) : 0;
    const SkPagedKeys<T, D> keys{k_pages, v_pages, block_table, k_sp, k_sh, k_sl, v_sp, v_sh,
                                 v_sl, t_sb, page_mul, page_shift, page_size, first};
    sk_attn_decode_body<T, D, WARPS, STAGES>(q, keys, nullptr, part_out, part_lse, q_sb, q_sh, q_sl,
                                     0, 0, 0, hq, hk, lq, len - first, chunk, scale,
                                     softcap, len - lq - first, causal, left, right);
}

// Merge partial attention states (softmaxkit.ops "merge_attention"): one warp per row r of
// outs [S, R, Dv] and lses [S, R] (natural log, -inf = empty part, NaN = a NaN row);
// out [R, Dv], lse [R].
template <typename Tin, typename Tout>
__global__ void __launch_bounds__(256) sk_merge_attn(
    const Tin* __restrict__ outs, const float* __restrict__ lses, Tout* __restrict__ out,
    float* __restrict__ lse, int parts, long long rows, int dv) {
    const long long r = static_cast<long long>(blockIdx.x) * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    float m = -SK_INF;
    bool nan = false;
    for (int s = lane; s < parts; s += 32) {
        const float ls = lses[s * rows + r];
        nan |= ls != ls;
        m = fmaxf(m, ls);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (__any_sync(0xffffffffu, nan)) {  // a NaN part makes the row NaN (never empty)
        for (int c = lane; c < dv; c += 32) out[r * dv + c] = sk_from_float<Tout>(SK_NAN);
        if (lane == 0) lse[r] = SK_NAN;
        return;
    }
    const float use = m == -SK_INF ? 0.0f : m;
    float total = 0.0f;
    for (int s = lane; s < parts; s += 32) {
        const float ls = lses[s * rows + r];
        total += ls == -SK_INF ? 0.0f : expf(ls - use);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int c = lane; c < dv; c += 32) {
        float acc = 0.0f;
        for (int s = 0; s < parts; ++s) {
            const float ls = lses[s * rows + r];
            if (ls != -SK_INF) acc += expf(ls - use) * sk_to_float(outs[(s * rows + r) * dv + c]);
        }
        out[r * dv + c] = sk_from_float<Tout>(acc * inv);
    }
    if (lane == 0) lse[r] = total > 0.0f ? use + logf(total) : -SK_INF;
}
