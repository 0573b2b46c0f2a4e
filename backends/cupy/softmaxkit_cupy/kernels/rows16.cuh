// Lean 16-bit row kernels: softmax and log_softmax from 16-bit inputs to results of the same
// type, the same edge rules as rows.cu (whose loader, reductions and stores they share), with
// the per-element work cut to what the 16-bit bound needs:
//   - every 16-byte load of a full row segment is issued before the first use
//     (ld.global.nc.L1::no_allocate.v4), results leave as whole 16-byte stores;
//   - the thread maximum is taken on the packed words (max.NaN.bf16x2 / .f16x2: one
//     instruction per two elements, and a NaN anywhere reaches the maximum, so no per-element
//     NaN test);
//   - exponentials are one subtraction, one multiply by log2(e) and one ex2.approx.ftz (its
//     2^-22 relative error and flushing below 2^-126 are inside the spec's u_A and tiny_D
//     terms); softmax keeps them in float32 registers, so each probability is one multiply
//     and one rounding, never a re-rounded 16-bit exponential, except in the persistent
//     kernel with SK_EX_CACHE (rows above 262144 elements): it caches each exponential in
//     the staged row as a 16-bit value; that second rounding (u_D relative, or below 2^-25
//     absolute for float16 subnormals, inside tiny_D) and the output's make the spec's
//     2 u_D, and its u_A (c + N) term, at least 2^-6 there, covers the cross term u_D^2;
//   - special rows (NaN, +inf, nothing allowed) take a separate, row-uniform branch, so the
//     regular path has no per-element selects.
// (x - M) is formed before scaling: folding M * log2(e) into one FMA would cost |M| u_A of
// relative error, outside the spec's bound for large |M|.
#pragma once

#define SK_LOG2E 1.4426950408889634f

template <typename T> struct SkPacked;
template <> struct SkPacked<sk_bf16> {
    static __device__ __forceinline__ unsigned max2(unsigned a, unsigned b) {
        unsigned d;
        asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
        return d;
    }
    static __device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(unsigned w) {
        return __uint_as_float(w & 0xffff0000u);
    }
    static __device__ __forceinline__ unsigned pack(float a, float b) {
        __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<unsigned*>(&v);
    }
};
template <> struct SkPacked<__half> {
    static __device__ __forceinline__ unsigned max2(unsigned a, unsigned b) {
        unsigned d;
        asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
        return d;
    }
    static __device__ __forceinline__ float lo(unsigned w) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    }
    static __device__ __forceinline__ float hi(unsigned w) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
    }
    static __device__ __forceinline__ unsigned pack(float a, float b) {
        __half2 v = __floats2half2_rn(a, b);
        return *reinterpret_cast<unsigned*>(&v);
    }
};

// Cache modes of the global accesses (MODE bits): 1 streaming stores (st.global.cs), 2
// streaming loads (ld.global.cs.nc), 4 a 256-byte L2 prefetch with each load; and 8, for
// softmax in sk_rows16_persist only, exponentials cached in the staged row (SK_EX_CACHE).
#define SK_ST_CS 1
#define SK_LD_CS 2
#define SK_LD_PF 4
#define SK_EX_CACHE 8

template <int MODE> __device__ __forceinline__ uint4 sk_ld_stream(const void* p) {
    uint4 v;
    if (MODE & SK_LD_CS) {
        asm("ld.global.cs.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if (MODE & SK_LD_PF) {
        asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    }
    return v;
}
template <int MODE> __device__ __forceinline__ void sk_st16(void* p, uint4 v) {
    if (MODE & SK_ST_CS) {
        asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                     ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    } else {
        asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                     ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    }
}
__device__ __forceinline__ uint4 sk_ld_shared16(const uint4* p) {
    uint4 v;
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(s) : "memory");
    return v;
}
__device__ __forceinline__ void sk_st_shared16(uint4* p, uint4 v) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 ::"r"(s), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ unsigned sk_word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ void sk_set_word(uint4& v, int i, unsigned w) {
    if (i == 0) v.x = w; else if (i == 1) v.y = w; else if (i == 2) v.z = w; else v.w = w;
}

// The packed maximum of N 16-byte pieces as a float, and whether any element is NaN.
template <typename T, int N>
__device__ __forceinline__ float sk_pieces_max(const uint4 (&p)[N], int& nan) {
    // four independent chains, one per word of a piece
    unsigned w0 = p[0].x, w1 = p[0].y, w2 = p[0].z, w3 = p[0].w;
#pragma unroll
    for (int j = 1; j < N; ++j) {
        w0 = SkPacked<T>::max2(w0, p[j].x);
        w1 = SkPacked<T>::max2(w1, p[j].y);
        w2 = SkPacked<T>::max2(w2, p[j].z);
        w3 = SkPacked<T>::max2(w3, p[j].w);
    }
    const unsigned top = SkPacked<T>::max2(SkPacked<T>::max2(w0, w1), SkPacked<T>::max2(w2, w3));
    const float a = SkPacked<T>::lo(top), b = SkPacked<T>::hi(top);
    nan |= (a != a) | (b != b);
    return fmaxf(a, b);
}

__device__ __forceinline__ float sk_max_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// Each thread's (m, s) (m NaN where the thread saw a NaN) -> the group's (M, S) in every thread
// of it: M the maximum (NaN if any m is), S the sum of the s rescaled from their m to M.  Two
// plain butterflies (maximum, then sum) instead of a merge per step; blocks (G > 32) combine
// the warps' pairs through shared memory.
template <int THREADS, int G>
__device__ __forceinline__ void sk_lean_reduce(float& m, float& s, float* scratch) {
    constexpr int WIDTH = G < 32 ? G : 32;
    float top = m;
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off /= 2)
        top = sk_max_nan(top, __shfl_xor_sync(0xffffffffu, top, off));
    s = m == -SK_INF ? 0.0f : s * sk_ex2((m - top) * SK_LOG2E);
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    m = top;
    if (G > 32) {
        constexpr int WARPS = THREADS / 32;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (lane == 0) {
            scratch[warp] = m;
            scratch[WARPS + warp] = s;
        }
        __syncthreads();
        top = scratch[0];
#pragma unroll
        for (int i = 1; i < WARPS; ++i) top = sk_max_nan(top, scratch[i]);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) {
            const float mi = scratch[i];
            sum += mi == -SK_INF ? 0.0f : scratch[WARPS + i] * sk_ex2((mi - top) * SK_LOG2E);
        }
        m = top;
        s = sum;
    }
}

// The output of a special row (is_nan, posinf, empty) at an element of value f.
template <int OP>
__device__ __forceinline__ float sk_special(float f, bool is_nan, bool posinf, int masked_nan) {
    if (OP == SK_SOFTMAX) return (is_nan || posinf || masked_nan) ? SK_NAN : 0.0f;
    if (is_nan || (!posinf && masked_nan)) return SK_NAN;
    if (posinf) return f == SK_INF ? SK_NAN : -SK_INF;
    return -SK_INF;
}

// A piece's results on a special row (is_nan, posinf, empty).
template <typename T, int OP>
__device__ __forceinline__ uint4 sk_special_piece(uint4 p, bool is_nan, bool posinf,
                                                  int masked_nan) {
    uint4 o;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned word = sk_word(p, i);
        sk_set_word(o, i, SkPacked<T>::pack(
            sk_special<OP>(SkPacked<T>::lo(word), is_nan, posinf, masked_nan),
            sk_special<OP>(SkPacked<T>::hi(word), is_nan, posinf, masked_nan)));
    }
    return o;
}

// A piece's results on a regular row of maximum m and sum s (log2s = log2 s, logs = log s):
// log_softmax (x - m) - log s; softmax recomputes each exponential, one FMA-shifted ex2.
template <typename T, int OP>
__device__ __forceinline__ uint4 sk_regular_piece(uint4 p, float m, float log2s, float logs) {
    uint4 o;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned word = sk_word(p, i);
        const float a = SkPacked<T>::lo(word) - m, b = SkPacked<T>::hi(word) - m;
        if (OP == SK_SOFTMAX) {
            sk_set_word(o, i, SkPacked<T>::pack(sk_ex2(fmaf(a, SK_LOG2E, -log2s)),
                                                sk_ex2(fmaf(b, SK_LOG2E, -log2s))));
        } else {
            sk_set_word(o, i, SkPacked<T>::pack(a - logs, b - logs));
        }
    }
    return o;
}

// A piece of 16-bit exponentials times one scale (softmax from cached exponentials).
template <typename T>
__device__ __forceinline__ uint4 sk_scaled_piece(uint4 e, float scale) {
    uint4 o;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned word = sk_word(e, i);
        sk_set_word(o, i, SkPacked<T>::pack(SkPacked<T>::lo(word) * scale,
                                            SkPacked<T>::hi(word) * scale));
    }
    return o;
}

// Write piece j of results (o) at element base: one 16-byte store where the row allows it.
template <typename T, int MODE>
__device__ __forceinline__ void sk_put16(T* orow, int base, int n, int vec_ok, bool fast,
                                         uint4 o) {
    if (fast) {
        sk_st16<MODE>(orow + base, o);
    } else {
        T v[8];
        *reinterpret_cast<uint4*>(v) = o;
        sk_rows_store<T, 8>(orow, base, n, vec_ok, v);
    }
}

// Load a thread's K pieces of row segment [0, G K VEC) of `row` (all loads issued before any
// use where the segment is whole, aligned and unmasked; otherwise through sk_rows_load).
template <typename T, int G, int K, int MODE>
__device__ __forceinline__ void sk_rows16_fetch(
    uint4 (&raw)[K], const T* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, long long row, bool active, int lane, int n, int vec_ok) {
    if (active && vec_ok && w == nullptr && (lane + (K - 1) * G) * 8 < n) {
        const T* xr = x + row * ld_x + lane * 8;
#pragma unroll
        for (int j = 0; j < K; ++j) raw[j] = sk_ld_stream<MODE>(xr + j * G * 8);
    } else {
        sk_rows_load<T, G, K>(raw, x, ld_x, w, ld_w, row, active, 0, lane, n, vec_ok);
    }
}

// Reduce the row held in raw (by the G threads of its group) and write its result.  Every
// thread of the block calls it (the reduction synchronizes blocks with G > 32).
template <typename T, int OP, int THREADS, int G, int K, int MODE>
__device__ __forceinline__ void sk_rows16_finish(
    const uint4 (&raw)[K], T* __restrict__ out, long long ld_o, long long row, bool active,
    int lane, int n, int vec_ok, int masked_nan, float* scratch) {
    constexpr int VEC = 8;
    int nan = 0;
    const float m = sk_pieces_max<T, K>(raw, nan);
    // the shift for this thread's exponentials: its maximum when finite (otherwise every
    // exponential is 0 (-inf) or the row is special and they are not used)
    const float ms = (m > -SK_INF && m < SK_INF) ? m : 0.0f;
    float ex[OP == SK_SOFTMAX ? K * VEC : 1];
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned word = sk_word(raw[j], i);
            const float a = sk_ex2((SkPacked<T>::lo(word) - ms) * SK_LOG2E);
            const float b = sk_ex2((SkPacked<T>::hi(word) - ms) * SK_LOG2E);
            s += a + b;
            if (OP == SK_SOFTMAX) {
                ex[j * VEC + 2 * i] = a;
                ex[j * VEC + 2 * i + 1] = b;
            }
        }
    }
    float mr = nan ? SK_NAN : m;
    sk_lean_reduce<THREADS, G>(mr, s, scratch);

    if (!active) return;
    const bool is_nan = mr != mr;
    const bool posinf = mr == SK_INF;
    const bool empty = mr == -SK_INF;
    T* orow = out + row * ld_o;
    const bool fast_out = vec_ok && (lane + (K - 1) * G) * VEC < n;
    if (!(is_nan || posinf || empty)) {
        if (OP == SK_SOFTMAX) {
            const float scale = m == -SK_INF ? 0.0f : sk_ex2((ms - mr) * SK_LOG2E) / s;
#pragma unroll
            for (int j = 0; j < K; ++j) {
                uint4 o;
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    sk_set_word(o, i, SkPacked<T>::pack(ex[j * VEC + 2 * i] * scale,
                                                        ex[j * VEC + 2 * i + 1] * scale));
                sk_put16<T, MODE>(orow, (j * G + lane) * VEC, n, vec_ok, fast_out, o);
            }
        } else {
            const float logs = sk_log<false>(s);
#pragma unroll
            for (int j = 0; j < K; ++j) {
                sk_put16<T, MODE>(orow, (j * G + lane) * VEC, n, vec_ok, fast_out,
                                  sk_regular_piece<T, OP>(raw[j], mr, 0.0f, logs));
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < K; ++j) {
            sk_put16<T, MODE>(orow, (j * G + lane) * VEC, n, vec_ok, fast_out,
                              sk_special_piece<T, OP>(raw[j], is_nan, posinf, masked_nan));
        }
    }
}

// One row segment per G threads, K 16-byte pieces per thread, held in registers.
template <typename T, int OP, int THREADS, int G, int K, int MODE>
__global__ void __launch_bounds__(THREADS, SK_ROWS_MIN_BLOCKS(THREADS, K)) sk_rows16(
    const T* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, T* __restrict__ out, long long ld_o, long long rows, int n, int vec_ok,
    int masked_nan) {
    static_assert(sizeof(T) == 2 && OP != SK_LOGSUMEXP, "16-bit softmax / log_softmax");
    __shared__ float scratch[2 * (THREADS / 32 + 1)];
    const int lane = sk_group_lane<THREADS, G>();
    const long long row = sk_group_row<THREADS, G>();
    const bool active = row < rows;
    uint4 raw[K];
    sk_rows16_fetch<T, G, K, MODE>(raw, x, ld_x, w, ld_w, row, active, lane, n, vec_ok);
    sk_rows16_finish<T, OP, THREADS, G, K, MODE>(raw, out, ld_o, row, active, lane, n, vec_ok,
                                                 masked_nan, scratch);
}

__device__ __forceinline__ void sk_cp_async_wait_n(int n) {
    switch (n) {
        case 0: sk_cp_async_wait<0>(); break;
        case 1: sk_cp_async_wait<1>(); break;
        case 2: sk_cp_async_wait<2>(); break;
        case 3: sk_cp_async_wait<3>(); break;
        case 4: sk_cp_async_wait<4>(); break;
        case 5: sk_cp_async_wait<5>(); break;
        case 6: sk_cp_async_wait<6>(); break;
        default: sk_cp_async_wait<7>(); break;
    }
}

// This thread's PER pieces of copy group g from the stage (piece j of thread lane is at
// j * THREADS + lane).
template <int THREADS, int PER>
__device__ __forceinline__ void sk_read_group(uint4 (&p)[PER], const uint4* stage, int g,
                                              int lane) {
#pragma unroll
    for (int q = 0; q < PER; ++q) p[q] = sk_ld_shared16(&stage[(g * PER + q) * THREADS + lane]);
}

// Stage this thread's piece j of row r (its segment starting at seg0): one asynchronous copy
// where the segment is whole or the piece is in range and copyable (aligned, no mask), else
// loaded and masked.
template <typename T, int THREADS>
__device__ __forceinline__ void sk_stage_piece(uint4* stage, const T* x, long long ld_x,
                                               const unsigned char* w, long long ld_w,
                                               long long r, int seg0, int j, int lane, int n,
                                               int vec_ok, bool whole, bool copyable) {
    constexpr int VEC = 16 / sizeof(T);
    const int base = seg0 + (j * THREADS + lane) * VEC;
    uint4* dst = &stage[j * THREADS + lane];
    if (whole || (copyable && base < n)) {
        sk_cp_async16(dst, x + r * ld_x + base, true);
    } else {
        uint4 piece[1];
        sk_rows_load<T, THREADS, 1>(piece, x, ld_x, w, ld_w, r, true, seg0 + j * THREADS * VEC,
                                    lane, n, vec_ok);
        *dst = piece[0];
    }
}

// Fold a landed copy group's maximum into the thread's running (m, s): s is rescaled when m
// rises (0 while m is -inf; the new m may be +inf).  A NaN in the group sets nan and leaves m
// alone: the row is NaN anyway.
template <typename T, int PER>
__device__ __forceinline__ void sk_raise_max(const uint4 (&p)[PER], float& m, float& s,
                                             int& nan) {
    int gnan = 0;
    const float gm = sk_pieces_max<T, PER>(p, gnan);
    nan |= gnan;
    const float mn = fmaxf(m, gm);
    if (mn > m) {
        s = m == -SK_INF ? 0.0f : s * sk_ex2((m - mn) * SK_LOG2E);
        m = mn;
    }
}

// Add a copy group's exponentials, shifted by the running maximum m, to s (nothing to add
// while m is -inf; an infinite m makes the row special and s unused).
template <typename T, int PER>
__device__ __forceinline__ void sk_add_exponentials(const uint4 (&p)[PER], float m, float& s) {
    if (m > -SK_INF && m < SK_INF) {
#pragma unroll
        for (int q = 0; q < PER; ++q)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned word = sk_word(p[q], i);
                s += sk_ex2((SkPacked<T>::lo(word) - m) * SK_LOG2E) +
                     sk_ex2((SkPacked<T>::hi(word) - m) * SK_LOG2E);
            }
    }
}

// Wait for copy group g (of GROUPS), read this thread's pieces of it into p and fold its
// maximum into the running (m, s) (sk_raise_max).
template <typename T, int THREADS, int PER, int GROUPS>
__device__ __forceinline__ void sk_land_group(uint4 (&p)[PER], const uint4* stage, int g,
                                              int lane, float& m, float& s, int& nan) {
    sk_cp_async_wait_n(GROUPS - 1 - g);
    sk_read_group<THREADS, PER>(p, stage, g, lane);
    sk_raise_max<T, PER>(p, m, s, nan);
}

// Write the results of this thread's staged piece j (its segment starting at seg0) on a
// special row (is_nan, posinf, empty).
template <typename T, int OP, int THREADS, int MODE>
__device__ __forceinline__ void sk_put_special_staged(T* orow, const uint4* stage, int seg0,
                                                      int j, int lane, int n, int vec_ok,
                                                      bool is_nan, bool posinf, int masked_nan) {
    const int base = seg0 + (j * THREADS + lane) * 8;
    const uint4 p = sk_ld_shared16(&stage[j * THREADS + lane]);
    sk_put16<T, MODE>(orow, base, n, vec_ok, vec_ok && base < n,
                      sk_special_piece<T, OP>(p, is_nan, posinf, masked_nan));
}

// Long rows: a block (or, CLUSTER > 1, a cluster of blocks) per row, each thread's K pieces
// staged in shared memory by cp.async in GROUPS commit groups; the thread folds each group
// into its running (max, sum) as soon as it lands, while later groups are still in flight.
// The outputs recompute their exponentials from the staged inputs (one FMA-shifted ex2).
template <typename T, int OP, int THREADS, int K, int CLUSTER, int GROUPS, int MODE>
__global__ void SK_CLUSTER_DIMS(CLUSTER) __launch_bounds__(THREADS, 2048 / THREADS)
    sk_rows16_staged(
    const T* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, T* __restrict__ out, long long ld_o, long long rows, int n, int vec_ok,
    int masked_nan) {
    static_assert(sizeof(T) == 2 && OP != SK_LOGSUMEXP, "16-bit softmax / log_softmax");
    static_assert(K % GROUPS == 0 && GROUPS <= 8, "whole groups, at most 8 in flight");
    constexpr int VEC = 8;
    constexpr int PER = K / GROUPS;
    constexpr int CAP = THREADS * K * VEC;
    extern __shared__ uint4 sk_stage[];
    __shared__ float scratch[3 * (THREADS / 32 + 1)];
    __shared__ float summary[4];
    const int lane = threadIdx.x;
    const long long row = blockIdx.x / CLUSTER;
    const int seg0 = CLUSTER > 1 ? static_cast<int>(sk_cluster_rank()) * CAP : 0;
    const T* xr = x + row * ld_x;
    const bool fast = vec_ok && w == nullptr;
    // each thread stages, and later reads, only its own pieces: no barrier needed
    if (fast && seg0 + CAP <= n) {  // the whole segment in range: no per-piece tests
        const T* src = xr + seg0 + lane * VEC;
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
#pragma unroll
            for (int q = 0; q < PER; ++q) {
                const int j = g * PER + q;
                sk_cp_async16(&sk_stage[j * THREADS + lane], src + j * THREADS * VEC, true);
            }
            sk_cp_async_commit();
        }
    } else {
#pragma unroll 1
        for (int j = 0; j < K; ++j)
            sk_stage_piece<T, THREADS>(sk_stage, x, ld_x, w, ld_w, row, seg0, j, lane, n, vec_ok,
                                       false, fast);
        sk_cp_async_commit();
        sk_cp_async_wait<0>();  // landed: the group waits below return at once
    }

    float m = -SK_INF, s = 0.0f;
    int nan = 0;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
        uint4 p[PER];
        sk_land_group<T, THREADS, PER, GROUPS>(p, sk_stage, g, lane, m, s, nan);
        sk_add_exponentials<T, PER>(p, m, s);
    }
    sk_rows_reduce<THREADS, THREADS, CLUSTER, false>(m, s, nan, scratch, summary);

    const bool is_nan = nan != 0;
    const bool posinf = !is_nan && m == SK_INF;
    const bool empty = !is_nan && m == -SK_INF;
    T* orow = out + row * ld_o;
    if (!(is_nan || posinf || empty)) {
        const float log2s = log2f(s);
        const float logs = sk_log<false>(s);
#pragma unroll 4
        for (int j = 0; j < K; ++j) {
            const int base = seg0 + (j * THREADS + lane) * VEC;
            const uint4 p = sk_ld_shared16(&sk_stage[j * THREADS + lane]);
            sk_put16<T, MODE>(orow, base, n, vec_ok, vec_ok && base < n,
                              sk_regular_piece<T, OP>(p, m, log2s, logs));
        }
    } else {
#pragma unroll 1
        for (int j = 0; j < K; ++j)
            sk_put_special_staged<T, OP, THREADS, MODE>(orow, sk_stage, seg0, j, lane, n, vec_ok,
                                                        is_nan, posinf, masked_nan);
    }
    if (CLUSTER > 1) sk_cluster_wait();
}

// A float pair from a peer block's shared memory (distributed shared memory of the cluster).
__device__ __forceinline__ float2 sk_cluster_load2(const float2* smem, unsigned rank) {
#if SK_CLUSTERS
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    unsigned remote;
    float2 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];"
                 : "=f"(v.x), "=f"(v.y) : "r"(remote) : "memory");
    return v;
#else
    __trap();
    return make_float2(0.0f, 0.0f);
#endif
}

// Blocks of a staged kernel that fit on one multiprocessor (227 KB of shared memory, a
// block's static arrays and 1 KB reserved per block), for the register budget.
#define SK_STAGED_MIN_BLOCKS(THREADS, K)                                                 \
    ((232448 / ((THREADS) * (K) * 16 + 2048)) < 1                                       \
         ? 1                                                                             \
         : (232448 / ((THREADS) * (K) * 16 + 2048)) > 2048 / (THREADS)                   \
               ? 2048 / (THREADS)                                                        \
               : (232448 / ((THREADS) * (K) * 16 + 2048)))

// Persistent form of sk_rows16_staged: the grid is the clusters that fit at once, and
// cluster c walks rows c, c + C, c + 2C, ... (C clusters).  Each thread refills every staged
// piece with the next row's piece right after it has read the piece back for the current
// row's store, so the next row's copies are in flight while the current row is written,
// and no cluster waits for a launch between rows.  A thread reads back only the pieces it
// copied itself, so no block barrier guards the stage.  The (max, sum) exchange costs one
// cluster barrier per row: every warp publishes its summary, and after the barrier every warp
// combines all CLUSTER x WARPS summaries itself; the summaries alternate between two slots by
// row parity, so a slot is rewritten only after every peer has passed the barrier that
// follows its last read of it.
// With SK_EX_CACHE (softmax), the fold writes each exponential back over its input in the
// stage, rounded to T, relative to the thread's running maximum when its copy group landed
// (kept per group); after the exchange a probability is that exponential times one factor
// per group, exp(m_g - M) / S, so the store phase, which sits between the cluster barrier
// and the refill, has no ex2 per element.  An exponential is at most 1 (taken after the
// group's maximum), so it fits T; the extra rounding is covered as the header says.
template <typename T, int OP, int THREADS, int K, int CLUSTER, int GROUPS, int MODE>
__global__ void SK_CLUSTER_DIMS(CLUSTER)
    __launch_bounds__(THREADS, SK_STAGED_MIN_BLOCKS(THREADS, K)) sk_rows16_persist(
    const T* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, T* __restrict__ out, long long ld_o, long long rows, int n, int vec_ok,
    int masked_nan) {
    static_assert(sizeof(T) == 2 && OP != SK_LOGSUMEXP, "16-bit softmax / log_softmax");
    static_assert(K % GROUPS == 0 && GROUPS <= 8, "whole groups, at most 8 in flight");
    constexpr int VEC = 8;
    constexpr int PER = K / GROUPS;
    constexpr int CAP = THREADS * K * VEC;
    constexpr int WARPS = THREADS / 32;
    constexpr int SLOTS = CLUSTER * WARPS;  // summaries per row
    constexpr int EACH = (SLOTS + 31) / 32;  // of them per lane
    constexpr bool CACHE = OP == SK_SOFTMAX && (MODE & SK_EX_CACHE) != 0;
    extern __shared__ uint4 sk_stage[];
    __shared__ float2 sums[2][WARPS];  // (maximum or NaN, sum) per warp, by row parity
    const int lane = threadIdx.x;
    const int wlane = threadIdx.x % 32;
    const unsigned rank = CLUSTER > 1 ? sk_cluster_rank() : 0u;
    const int seg0 = static_cast<int>(rank) * CAP;
    const long long step = gridDim.x / CLUSTER;
    const bool copyable = vec_ok && w == nullptr;
    const bool fast = copyable && seg0 + CAP <= n;  // the whole segment: no per-piece tests

    // stage piece j of row r (asynchronous where the row allows it)
    auto stage = [&](long long r, int j) {
        sk_stage_piece<T, THREADS>(sk_stage, x, ld_x, w, ld_w, r, seg0, j, lane, n, vec_ok, fast,
                                   copyable);
    };

    long long row = blockIdx.x / CLUSTER;
    if (row < rows) {
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
#pragma unroll
            for (int q = 0; q < PER; ++q) stage(row, g * PER + q);
            sk_cp_async_commit();
        }
    }
    int parity = 0;
#pragma unroll 1
    for (; row < rows; row += step, parity ^= 1) {
        float m = -SK_INF, s = 0.0f;
        int nan = 0;
        float mg[GROUPS];  // (CACHE) the shift of each group's cached exponentials
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            uint4 p[PER];
            sk_land_group<T, THREADS, PER, GROUPS>(p, sk_stage, g, lane, m, s, nan);
            if (CACHE) {
                // no branch: while m is -inf the group holds only -inf (exponentials 0, and
                // its factor below is 0) or NaN; m = +inf makes the row special, and special
                // softmax rows never read the stage
                const float sh = m > -SK_INF && m < SK_INF ? m : 0.0f;
                mg[g] = m;
#pragma unroll
                for (int q = 0; q < PER; ++q) {
                    uint4 e;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const unsigned word = sk_word(p[q], i);
                        const float a = sk_ex2((SkPacked<T>::lo(word) - sh) * SK_LOG2E);
                        const float b = sk_ex2((SkPacked<T>::hi(word) - sh) * SK_LOG2E);
                        s += a + b;
                        sk_set_word(e, i, SkPacked<T>::pack(a, b));
                    }
                    sk_st_shared16(&sk_stage[(g * PER + q) * THREADS + lane], e);
                }
            } else {
                sk_add_exponentials<T, PER>(p, m, s);
            }
        }
        // the warp's summary, then every warp combines the whole cluster's
        float mr = nan ? SK_NAN : m;
        sk_lean_reduce<32, 32>(mr, s, nullptr);
        if (wlane == 0) sums[parity][threadIdx.x / 32] = make_float2(mr, s);
        if (CLUSTER > 1) {
            sk_cluster_arrive();
            sk_cluster_wait();
        } else {
            __syncthreads();
        }
        float2 got[EACH];
        float top = -SK_INF;
#pragma unroll
        for (int e = 0; e < EACH; ++e) {
            const int slot = wlane + 32 * e;
            got[e] = make_float2(-SK_INF, 0.0f);
            if (slot < SLOTS) {
                const float2* at = &sums[parity][slot % WARPS];
                got[e] = CLUSTER > 1 ? sk_cluster_load2(at, slot / WARPS) : *at;
            }
            top = sk_max_nan(top, got[e].x);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2)
            top = sk_max_nan(top, __shfl_xor_sync(0xffffffffu, top, off));
        s = 0.0f;
#pragma unroll
        for (int e = 0; e < EACH; ++e)
            s += got[e].x == -SK_INF ? 0.0f : got[e].y * sk_ex2((got[e].x - top) * SK_LOG2E);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        m = top;

        const bool is_nan = m != m;
        const bool posinf = m == SK_INF;
        const bool empty = m == -SK_INF;
        const long long next = row + step;
        const bool more = next < rows;
        T* orow = out + row * ld_o;
        if (!(is_nan || posinf || empty)) {
            const float log2s = log2f(s);
            const float logs = sk_log<false>(s);
            const float inv = 1.0f / s;
#pragma unroll
            for (int g = 0; g < GROUPS; ++g) {
                // (CACHE) exp(m_g - M) / S: 0 for a group cached while m was -inf
                const float scale = CACHE ? sk_ex2((mg[g] - m) * SK_LOG2E) * inv : 0.0f;
                uint4 pg[PER];  // the group read back first, then written and refilled
                sk_read_group<THREADS, PER>(pg, sk_stage, g, lane);
#pragma unroll
                for (int q = 0; q < PER; ++q) {
                    const int j = g * PER + q;
                    const int base = seg0 + (j * THREADS + lane) * VEC;
                    const uint4 o = CACHE ? sk_scaled_piece<T>(pg[q], scale)
                                          : sk_regular_piece<T, OP>(pg[q], m, log2s, logs);
                    sk_put16<T, MODE>(orow, base, n, vec_ok, fast || (vec_ok && base < n), o);
                    // the piece is read back (its results depend on it, so the store waits
                    // for the read): refill it
                    if (more) stage(next, j);
                }
                sk_cp_async_commit();
            }
        } else {
#pragma unroll 1
            for (int g = 0; g < GROUPS; ++g) {
#pragma unroll 1
                for (int q = 0; q < PER; ++q) {
                    const int j = g * PER + q;
                    sk_put_special_staged<T, OP, THREADS, MODE>(orow, sk_stage, seg0, j, lane, n,
                                                                vec_ok, is_nan, posinf,
                                                                masked_nan);
                    if (more) stage(next, j);
                }
                sk_cp_async_commit();
            }
        }
    }
    // peers may still read this block's summaries: leave only when every block is done
    if (CLUSTER > 1) {
        sk_cluster_arrive();
        sk_cluster_wait();
    }
}
