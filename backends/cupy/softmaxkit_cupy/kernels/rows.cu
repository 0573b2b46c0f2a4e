// Row kernels: softmax, log_softmax and logsumexp along the last axis of [rows, n] arrays.
//
// G threads own one row segment of up to G * K * VEC elements (VEC elements per 16-byte
// load), held in registers from the single read until the single write.  G < 32 packs
// several rows in a warp; G == THREADS gives one block per row; CLUSTER > 1 splits a row over
// the blocks of a thread-block cluster, which exchange (max, sum) summaries through
// distributed shared memory.  Each thread first summarizes its own elements (local maximum,
// sum of exponentials shifted by it, stored exponentials for softmax), so every element costs
// one exponential, and the group merges the summaries once.
//
// Edge rules (spec/semantics.md, softmaxkit/reference/rows.py): excluded positions become
// -inf at load; an allowed NaN makes the row NaN; an allowed +inf makes softmax NaN,
// log_softmax NaN at the +inf positions and -inf elsewhere, logsumexp +inf; a row with
// nothing above -inf gives 0 / -inf / -inf, or NaN under masked="nan".  (mma.cuh brings the
// asynchronous copies the staged kernels of rows16.cuh use.)
#include "mma.cuh"

#define SK_SOFTMAX 0
#define SK_LOG_SOFTMAX 1
#define SK_LOGSUMEXP 2

template <typename T> struct SkPair;
template <> struct SkPair<float> { typedef float2 type; };
template <> struct SkPair<__half> { typedef __half2 type; };
template <> struct SkPair<sk_bf16> { typedef __nv_bfloat162 type; };

__device__ __forceinline__ float2 sk_pack2(float a, float b, float2*) { return make_float2(a, b); }
__device__ __forceinline__ __half2 sk_pack2(float a, float b, __half2*) {
    return __floats2half2_rn(a, b);
}
__device__ __forceinline__ __nv_bfloat162 sk_pack2(float a, float b, __nv_bfloat162*) {
    return __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ float2 sk_unpack2(float2 v) { return v; }
__device__ __forceinline__ float2 sk_unpack2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 sk_unpack2(__nv_bfloat162 v) { return __bfloat1622float2(v); }

template <bool WIDE> struct SkWide { typedef float type; };
template <> struct SkWide<true> { typedef double type; };

// Groups of G threads, THREADS / G of them per block, one row each: this thread's lane in its
// group, and its group's row.
template <int THREADS, int G> __device__ __forceinline__ int sk_group_lane() {
    return G < THREADS ? threadIdx.x % G : threadIdx.x;
}
template <int THREADS, int G> __device__ __forceinline__ long long sk_group_row() {
    return static_cast<long long>(blockIdx.x) * (THREADS / G) + threadIdx.x / G;
}

// Merge two summaries: (m, s) with s the shifted sum, or with REST (logsumexp) (m, t) with
// t = s - 1 (sk_merge_rest), whose empty value is -1 instead of 0.
template <bool PRECISE, bool REST>
__device__ __forceinline__ void sk_merge_any(float& m, float& s, float m2, float s2) {
    if (REST) sk_merge_rest<PRECISE>(m, s, m2, s2);
    else sk_merge<PRECISE>(m, s, m2, s2);
}

// Merge (m, s, nan) over groups of WIDTH lanes of a warp by an xor butterfly; the result is
// in every lane of each group.
template <int WIDTH, bool PRECISE, bool REST>
__device__ __forceinline__ void sk_warp_merge(float& m, float& s, int& nan) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off /= 2) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        nan |= __shfl_xor_sync(0xffffffffu, nan, off);
        sk_merge_any<PRECISE, REST>(m, s, m2, s2);
    }
}

// Reduce (m, s, nan) over the G threads of a group; the result is in every thread of it.
template <int THREADS, int G, bool PRECISE, bool REST = false>
__device__ __forceinline__ void sk_group_reduce(float& m, float& s, int& nan, float* scratch) {
    constexpr int WIDTH = G < 32 ? G : 32;
    constexpr float EMPTY_S = REST ? -1.0f : 0.0f;
    sk_warp_merge<WIDTH, PRECISE, REST>(m, s, nan);
    if (G > 32) {
        constexpr int WARPS = THREADS / 32;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (lane == 0) {
            scratch[warp] = m;
            scratch[WARPS + warp] = s;
            scratch[2 * WARPS + warp] = __int_as_float(nan);
        }
        __syncthreads();
        m = lane < WARPS ? scratch[lane] : -SK_INF;
        s = lane < WARPS ? scratch[WARPS + lane] : EMPTY_S;
        nan = lane < WARPS ? __float_as_int(scratch[2 * WARPS + lane]) : 0;
        sk_warp_merge<32, PRECISE, REST>(m, s, nan);
    }
}

// Merge (m, s, nan) over the row: the group, then (CLUSTER > 1) the cluster's blocks through
// distributed shared memory.  Every thread of the block ends with the row's summary.
template <int THREADS, int G, int CLUSTER, bool PRECISE, bool REST = false>
__device__ __forceinline__ void sk_rows_reduce(float& m, float& s, int& nan, float* scratch,
                                               float* summary) {
    sk_group_reduce<THREADS, G, PRECISE, REST>(m, s, nan, scratch);
    if (CLUSTER > 1) {
        if (threadIdx.x == 0) {
            summary[0] = m;
            summary[1] = s;
            summary[2] = __int_as_float(nan);
        }
        sk_cluster_arrive();
        sk_cluster_wait();
        if (threadIdx.x < 32) {
            const unsigned r = threadIdx.x;
            m = r < CLUSTER ? sk_cluster_load(&summary[0], r) : -SK_INF;
            s = r < CLUSTER ? sk_cluster_load(&summary[1], r) : (REST ? -1.0f : 0.0f);
            nan = r < CLUSTER ? __float_as_int(sk_cluster_load(&summary[2], r)) : 0;
            sk_warp_merge<32, PRECISE, REST>(m, s, nan);
        }
        // peers may still read this block's summary: leave only after they all arrive again
        sk_cluster_arrive();
        if (threadIdx.x == 0) {
            scratch[0] = m;
            scratch[1] = s;
            scratch[2] = __int_as_float(nan);
        }
        __syncthreads();
        m = scratch[0];
        s = scratch[1];
        nan = __float_as_int(scratch[2]);
    }
}

// Write one piece of VEC results at base (16-byte or 8-byte stores on aligned rows).
template <typename Tout, int VEC>
__device__ __forceinline__ void sk_rows_store(Tout* orow, int base, int n, int vec_ok,
                                              Tout (&o)[VEC]) {
    if (vec_ok && base < n) {
        constexpr int BYTES = VEC * sizeof(Tout);
        if (BYTES >= 16) {
#pragma unroll
            for (int c = 0; c < BYTES / 16; ++c)
                reinterpret_cast<uint4*>(orow + base)[c] = reinterpret_cast<uint4*>(o)[c];
        } else {
            *reinterpret_cast<uint2*>(orow + base) = *reinterpret_cast<uint2*>(o);
        }
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            if (base + e < n) orow[base + e] = o[e];
    }
}

// The VEC mask bytes of a 16-byte piece in one load (the piece's alignment covers them).
template <int VEC>
__device__ __forceinline__ void sk_load_keep(unsigned char (&keep)[VEC],
                                             const unsigned char* wp) {
    if (VEC == 8) {
        *reinterpret_cast<uint2*>(keep) = *reinterpret_cast<const uint2*>(wp);
    } else {
        *reinterpret_cast<unsigned*>(keep) = *reinterpret_cast<const unsigned*>(wp);
    }
}

// Load this thread's K 16-byte pieces of row segment [seg0, seg0 + G K VEC) of `row` into
// raw, excluded and missing positions as -inf.
template <typename Tin, int G, int K>
__device__ __forceinline__ void sk_rows_load(
    uint4 (&raw)[K], const Tin* __restrict__ x, long long ld_x,
    const unsigned char* __restrict__ w, long long ld_w, long long row, bool active, int seg0,
    int lane, int n, int vec_ok) {
    constexpr int VEC = 16 / sizeof(Tin);
    const Tin* xr = x + row * ld_x;
    const unsigned char* wr = w ? w + row * ld_w : nullptr;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const int base = seg0 + (j * G + lane) * VEC;
        Tin* v = reinterpret_cast<Tin*>(&raw[j]);
        if (active && vec_ok && base < n) {
            raw[j] = __ldg(reinterpret_cast<const uint4*>(xr + base));
            if (wr) {
                unsigned char keep[VEC];
                sk_load_keep<VEC>(keep, wr + base);
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    if (!keep[e]) v[e] = sk_from_float<Tin>(-SK_INF);
            }
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const int i = base + e;
                const bool in = active && i < n && (!wr || wr[i]);
                v[e] = in ? xr[i] : sk_from_float<Tin>(-SK_INF);
            }
        }
    }
}

// Reduce the row held in raw (loaded by sk_rows_load) and write its result.
template <typename Tin, typename Tout, int OP, int THREADS, int G, int K, int CLUSTER>
__device__ __forceinline__ void sk_rows_finish(
    uint4 (&raw)[K], Tout* __restrict__ out, long long ld_o, long long row, bool active,
    int seg0, int lane, int n, int vec_ok, int masked_nan, float* scratch, float* summary) {
    constexpr int VEC = 16 / sizeof(Tin);
    constexpr bool PRECISE = sizeof(Tout) == 4;
    // softmax keeps its exponentials in the output precision (float32 for float32 output)
    typedef typename SkPair<Tout>::type E2;

    // this thread's summary: maximum (NaN ignored), NaN flag, then the shifted sum
    float m = -SK_INF;
    int nan = 0;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const Tin* v = reinterpret_cast<const Tin*>(&raw[j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float f = sk_to_float(v[e]);
            nan |= f != f;
            m = fmaxf(m, f);
        }
    }
    // float32 results accumulate each thread's share in double (the merges stay in float)
    typename SkWide<PRECISE>::type s_acc = 0;
    // logsumexp counts the terms at the maximum instead of summing them (t = S - 1 below)
    int tops = 0;
    // softmax overwrites the inputs with their exponentials when both are the same width
    constexpr bool IN_PLACE = sizeof(Tout) == sizeof(Tin);
    E2 ex_own[OP == SK_SOFTMAX && !IN_PLACE ? K * VEC / 2 : 1];
    E2* ex = IN_PLACE ? reinterpret_cast<E2*>(raw) : ex_own;
    const bool none = m == -SK_INF;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const Tin* v = reinterpret_cast<const Tin*>(&raw[j]);
#pragma unroll
        for (int e = 0; e < VEC; e += 2) {
            const float fa = sk_to_float(v[e]), fb = sk_to_float(v[e + 1]);
            float a = none ? 0.0f : sk_exp<PRECISE>(fa - m);
            float b = none ? 0.0f : sk_exp<PRECISE>(fb - m);
            if (OP == SK_LOGSUMEXP) {
                tops += (fa == m) + (fb == m);
                a = fa == m ? 0.0f : a;
                b = fb == m ? 0.0f : b;
            }
            s_acc += static_cast<decltype(s_acc)>(a) + static_cast<decltype(s_acc)>(b);
            if (OP == SK_SOFTMAX) ex[(j * VEC + e) / 2] = sk_pack2(a, b, static_cast<E2*>(nullptr));
        }
    }
    float s = static_cast<float>(s_acc);
    // logsumexp: t = S - 1 (the sum without one instance of the maximum), -1 when empty
    if (OP == SK_LOGSUMEXP) s = none ? -1.0f : static_cast<float>(s_acc + (tops - 1));
    const float m_thread = m;

    sk_rows_reduce<THREADS, G, CLUSTER, PRECISE, OP == SK_LOGSUMEXP>(m, s, nan, scratch,
                                                                     summary);

    if (active) {
        const bool is_nan = nan != 0;
        const bool posinf = !is_nan && m == SK_INF;
        const bool empty = !is_nan && m == -SK_INF;
        if (OP == SK_LOGSUMEXP) {
            if (lane == 0 && seg0 == 0) {
                // s holds t = S - 1: log1p keeps the share of terms far below the maximum
                float r = m + log1pf(s);
                if (is_nan) r = SK_NAN;
                else if (posinf) r = SK_INF;
                else if (empty) r = -SK_INF;
                out[row] = sk_from_float<Tout>(r);
            }
        } else {
            const float logs = sk_log<PRECISE>(s);
            const double logs_wide = PRECISE ? log(static_cast<double>(s)) : 0.0;
            const float scale = sk_exp<PRECISE>(m_thread - m) / s;
            Tout* orow = out + row * ld_o;
#pragma unroll
            for (int j = 0; j < K; ++j) {
                const int base = seg0 + (j * G + lane) * VEC;
                const Tin* v = reinterpret_cast<const Tin*>(&raw[j]);
                Tout o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float r;
                    if (OP == SK_SOFTMAX) {
                        const float2 pr = sk_unpack2(ex[(j * VEC + e) / 2]);
                        r = (e % 2 == 0 ? pr.x : pr.y) * scale;
                        if (is_nan || posinf || (empty && masked_nan)) r = SK_NAN;
                        else if (empty) r = 0.0f;
                    } else {
                        const float f = sk_to_float(v[e]);
                        // float32 results subtract in double: log(sum) is ~8 for long rows,
                        // and its float rounding would exceed the bound near log p = 0
                        r = PRECISE ? static_cast<float>(static_cast<double>(f - m) - logs_wide)
                                    : (f - m) - logs;
                        if (is_nan || (empty && masked_nan)) r = SK_NAN;
                        else if (posinf) r = f == SK_INF ? SK_NAN : -SK_INF;
                        else if (empty) r = -SK_INF;
                    }
                    o[e] = sk_from_float<Tout>(r);
                }
                sk_rows_store<Tout, VEC>(orow, base, n, vec_ok, o);
            }
        }
    }
    if (CLUSTER > 1) sk_cluster_wait();
}

template <typename Tin, typename Tout, int OP, int THREADS, int G, int K, int CLUSTER>
__device__ __forceinline__ void sk_rows_body(
    const Tin* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, Tout* __restrict__ out, long long ld_o, long long rows, int n, int vec_ok,
    int masked_nan) {
    constexpr int CAP = G * K * (16 / sizeof(Tin));
    __shared__ float scratch[3 * (THREADS / 32 + 1)];
    __shared__ float summary[4];
    const int lane = sk_group_lane<THREADS, G>();
    long long row;
    int seg0 = 0;
    if (CLUSTER > 1) {
        row = blockIdx.x / CLUSTER;
        seg0 = static_cast<int>(sk_cluster_rank()) * CAP;
    } else {
        row = sk_group_row<THREADS, G>();
    }
    const bool active = row < rows;  // only the last block of packed rows has idle groups
    uint4 raw[K];
    sk_rows_load<Tin, G, K>(raw, x, ld_x, w, ld_w, row, active, seg0, lane, n, vec_ok);
    sk_rows_finish<Tin, Tout, OP, THREADS, G, K, CLUSTER>(raw, out, ld_o, row, active, seg0, lane,
                                                          n, vec_ok, masked_nan, scratch, summary);
}

// Residency: register caps (32, 40, 64) that keep 2048, 1536 or 1024 threads per
// multiprocessor for one, two or four loads per thread; the longest rows take what they need.
#define SK_ROWS_MIN_BLOCKS(THREADS, K) \
    ((K) <= 1 ? 2048 / (THREADS) : (K) <= 2 ? 1536 / (THREADS) : (K) <= 4 ? 1024 / (THREADS) : 1)

template <typename Tin, typename Tout, int OP, int THREADS, int G, int K>
__global__ void __launch_bounds__(THREADS, SK_ROWS_MIN_BLOCKS(THREADS, K)) sk_rows(
    const Tin* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, Tout* __restrict__ out, long long ld_o, long long rows, int n, int vec_ok,
    int masked_nan) {
    sk_rows_body<Tin, Tout, OP, THREADS, G, K, 1>(x, ld_x, w, ld_w, out, ld_o, rows, n, vec_ok,
                                                  masked_nan);
}

template <typename Tin, typename Tout, int OP, int THREADS, int K, int CLUSTER>
__global__ void SK_CLUSTER_DIMS(CLUSTER)
    __launch_bounds__(THREADS, SK_ROWS_MIN_BLOCKS(THREADS, K)) sk_rows_cluster(
    const Tin* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, Tout* __restrict__ out, long long ld_o, long long rows, int n, int vec_ok,
    int masked_nan) {
    sk_rows_body<Tin, Tout, OP, THREADS, THREADS, K, CLUSTER>(x, ld_x, w, ld_w, out, ld_o, rows,
                                                              n, vec_ok, masked_nan);
}

// 16-bit softmax and log_softmax have leaner kernels of their own (registers or shared-memory
// staging):
#include "rows16.cuh"
