// Long 16-bit rows split over PARTS clusters of CLUSTER staged blocks each: blocks merge their
// (max, sum) within the cluster through distributed shared memory as sk_rows16_staged does,
// then the clusters of a row exchange theirs through per-row slots in global memory.
//
// Slot protocol (xchg, SK_SPLIT_STRIDE words per row, zero before the first launch and left
// zero by every launch): the leader block of each cluster writes its part's (m, s, nan) and
// then sets the part's flag with a release store; every block reads the other parts' flags
// with acquire loads, one part per lane of its first warp, for at most `spin` sleeps.  A part
// whose flag has not appeared by then is summarized again by the block from device memory, so
// a launch never waits on a cluster that is not resident (no deadlock, whatever the
// scheduling).  Each block then counts itself out on the row's counter (acq_rel); the last one
// (every flag is written before its writer counts out) clears the flags and the counter for
// the next launch on the stream.
#pragma once

#define SK_SPLIT_STRIDE 128  // words per row: flags [0, 16), counter 16, data 32 + 4 part
#define SK_SPLIT_COUNTER 16
#define SK_SPLIT_DATA 32

__device__ __forceinline__ void sk_st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned sk_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned sk_ld_relaxed(const unsigned* p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned sk_atom_add_acq_rel(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
                 : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Fold N 16-byte pieces into a thread's running (m, s, nan), the maximum first.
template <typename T, int N>
__device__ __forceinline__ void sk_fold16(const uint4 (&p)[N], float& m, float& s, int& nan) {
    int gnan = 0;
    const float gm = sk_pieces_max<T, N>(p, gnan);
    nan |= gnan;
    const float mn = fmaxf(m, gm);  // NaN pieces leave m alone: the row is NaN anyway
    if (mn > m) {  // rescale the running sum (0 while m is -inf); mn may be +inf
        s = m == -SK_INF ? 0.0f : s * sk_ex2((m - mn) * SK_LOG2E);
        m = mn;
    }
    if (m > -SK_INF && m < SK_INF) {
#pragma unroll
        for (int q = 0; q < N; ++q)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned word = sk_word(p[q], i);
                s += sk_ex2((SkPacked<T>::lo(word) - m) * SK_LOG2E) +
                     sk_ex2((SkPacked<T>::hi(word) - m) * SK_LOG2E);
            }
    }
}

// The block's summary of row elements [seg, seg + len) read from device memory (the fallback
// for a part whose slot did not appear).  Every thread calls it and gets the result.
template <typename T, int THREADS>
__device__ __noinline__ void sk_split_resummarize(
    const T* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w, long long ld_w,
    long long row, int seg, int len, int n, int vec_ok, float& m, float& s, int& nan,
    float* scratch) {
    m = -SK_INF;
    s = 0.0f;
    nan = 0;
#pragma unroll 1
    for (int off = 0; off < len; off += THREADS * 8) {
        uint4 piece[1];
        sk_rows_load<T, THREADS, 1>(piece, x, ld_x, w, ld_w, row, true, seg + off, threadIdx.x,
                                    min(n, seg + len), vec_ok);
        sk_fold16<T, 1>(piece, m, s, nan);
    }
    __syncthreads();  // scratch may still be read by slower warps of an earlier reduction
    sk_group_reduce<THREADS, THREADS, false>(m, s, nan, scratch);
    __syncthreads();
}

template <typename T, int OP, int THREADS, int K, int CLUSTER, int PARTS, int GROUPS, int MODE>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 2048 / THREADS)
    sk_rows16_split(
    const T* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, T* __restrict__ out, long long ld_o, long long rows, int n, int vec_ok,
    int masked_nan, unsigned* __restrict__ xchg, int spin) {
    static_assert(sizeof(T) == 2 && OP != SK_LOGSUMEXP, "16-bit softmax / log_softmax");
    static_assert(K % GROUPS == 0 && GROUPS <= 8, "whole groups, at most 8 in flight");
    static_assert(CLUSTER > 1 && PARTS > 1 && PARTS <= 16, "clusters of a row, one lane each");
    constexpr int VEC = 8;
    constexpr int PER = K / GROUPS;
    constexpr int CAP = THREADS * K * VEC;
    extern __shared__ uint4 sk_stage[];
    __shared__ float scratch[3 * (THREADS / 32 + 1)];
    __shared__ float summary[4];
    __shared__ float total[3];
    __shared__ unsigned missing_parts;
    const int lane = threadIdx.x;
    const long long row = blockIdx.x / (CLUSTER * PARTS);
    const int part = static_cast<int>(blockIdx.x / CLUSTER) % PARTS;
    const unsigned rank = sk_cluster_rank();
    const int seg0 = (part * CLUSTER + static_cast<int>(rank)) * CAP;
    const T* xr = x + row * ld_x;
    const bool fast = vec_ok && w == nullptr;
    if (fast && seg0 + CAP <= n) {
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
        for (int j = 0; j < K; ++j) {
            const int base = seg0 + (j * THREADS + lane) * VEC;
            uint4* dst = &sk_stage[j * THREADS + lane];
            if (fast && base < n) {
                sk_cp_async16(dst, xr + base, true);
            } else {
                uint4 piece[1];
                sk_rows_load<T, THREADS, 1>(piece, x, ld_x, w, ld_w, row, true,
                                            seg0 + j * THREADS * VEC, lane, n, vec_ok);
                *dst = piece[0];
            }
        }
        sk_cp_async_commit();
        sk_cp_async_wait<0>();
    }

    float m = -SK_INF, s = 0.0f;
    int nan = 0;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
        sk_cp_async_wait_n(GROUPS - 1 - g);
        uint4 p[PER];
#pragma unroll
        for (int q = 0; q < PER; ++q)
            p[q] = sk_ld_shared16(&sk_stage[(g * PER + q) * THREADS + lane]);
        sk_fold16<T, PER>(p, m, s, nan);
    }
    sk_rows_reduce<THREADS, THREADS, CLUSTER, false>(m, s, nan, scratch, summary);

    // across the clusters of the row: lane p of warp 0 brings part p's summary
    unsigned* slot = xchg + row * SK_SPLIT_STRIDE;
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0 && rank == 0) {
            unsigned* d = slot + SK_SPLIT_DATA + 4 * part;
            d[0] = __float_as_uint(m);
            d[1] = __float_as_uint(s);
            d[2] = static_cast<unsigned>(nan);
            sk_st_release(slot + part, 1u);
        }
        const int p = threadIdx.x;
        float pm = -SK_INF, ps = 0.0f;
        int pn = 0;
        bool miss = false;
        if (p == part) {
            pm = m;
            ps = s;
            pn = nan;
        } else if (p < PARTS) {
            unsigned flag = sk_ld_acquire(slot + p);
            for (int i = 0; flag == 0 && i < spin; ++i) {
                asm volatile("nanosleep.u32 64;" ::: "memory");
                flag = sk_ld_acquire(slot + p);
            }
            if (flag) {
                const unsigned* d = slot + SK_SPLIT_DATA + 4 * p;
                pm = __uint_as_float(sk_ld_relaxed(d));
                ps = __uint_as_float(sk_ld_relaxed(d + 1));
                pn = static_cast<int>(sk_ld_relaxed(d + 2));
            } else {
                miss = true;
            }
        }
        const unsigned missing = __ballot_sync(0xffffffffu, miss);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) {
            const float m2 = __shfl_xor_sync(0xffffffffu, pm, off);
            const float s2 = __shfl_xor_sync(0xffffffffu, ps, off);
            pn |= __shfl_xor_sync(0xffffffffu, pn, off);
            sk_merge<false>(pm, ps, m2, s2);
        }
        if (threadIdx.x == 0) {
            total[0] = pm;
            total[1] = ps;
            total[2] = __int_as_float(pn);
            missing_parts = missing;
            // every read of this block is done: count out; the last block clears the row
            if (sk_atom_add_acq_rel(slot + SK_SPLIT_COUNTER, 1u) == CLUSTER * PARTS - 1) {
#pragma unroll 1
                for (int q = 0; q < PARTS; ++q) slot[q] = 0u;
                slot[SK_SPLIT_COUNTER] = 0u;
            }
        }
    }
    __syncthreads();
    m = total[0];
    s = total[1];
    nan = __float_as_int(total[2]);
    const unsigned missing = missing_parts;
    if (missing) {  // block-uniform: the parts that did not appear in time, from memory
#pragma unroll 1
        for (int q = 0; q < PARTS; ++q) {
            if (!((missing >> q) & 1u)) continue;
            float qm, qs;
            int qn;
            sk_split_resummarize<T, THREADS>(x, ld_x, w, ld_w, row, q * CLUSTER * CAP,
                                             CLUSTER * CAP, n, vec_ok, qm, qs, qn, scratch);
            nan |= qn;
            sk_merge<false>(m, s, qm, qs);
        }
    }

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
            sk_put16<T, MODE>(orow, base, n, vec_ok, vec_ok && base < n, o);
        }
    } else {
#pragma unroll 1
        for (int j = 0; j < K; ++j) {
            const int base = seg0 + (j * THREADS + lane) * VEC;
            const uint4 p = sk_ld_shared16(&sk_stage[j * THREADS + lane]);
            uint4 o;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned word = sk_word(p, i);
                sk_set_word(o, i, SkPacked<T>::pack(
                    sk_special<OP>(SkPacked<T>::lo(word), is_nan, posinf, masked_nan),
                    sk_special<OP>(SkPacked<T>::hi(word), is_nan, posinf, masked_nan)));
            }
            sk_put16<T, MODE>(orow, base, n, vec_ok, vec_ok && base < n, o);
        }
    }
    sk_cluster_wait();
}
