// Shared device code: 16-bit conversions, exponentials, summary merge, cluster access.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef __nv_bfloat16 sk_bf16;

#define SK_INF __int_as_float(0x7f800000)
#define SK_NAN __int_as_float(0x7fffffff)

__device__ __forceinline__ float sk_to_float(float v) { return v; }
__device__ __forceinline__ float sk_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float sk_to_float(sk_bf16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T sk_from_float(float v);
template <> __device__ __forceinline__ float sk_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half sk_from_float<__half>(float v) {
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ sk_bf16 sk_from_float<sk_bf16>(float v) {
    return __float2bfloat16_rn(v);
}

// exp: the accurate libm version when the result is stored in float32, the one-instruction
// approximation (relative error far below 16-bit rounding) otherwise.
template <bool PRECISE> __device__ __forceinline__ float sk_exp(float v) {
    if (PRECISE) return expf(v);
    return exp2f(v * 1.4426950408889634f);
}
// 2^x in one MUFU instruction (relative error about 2^-22; -inf gives +0 and results below
// the normal range flush to 0), for probabilities that are summed or rounded to 16 bits.
__device__ __forceinline__ float sk_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// A capped score in log2 units, softcap tanh(x / softcap) log2(e), from the scaled score x and
// inv_cap = 1 / softcap: tanh(y) = 1 - 2 / (2^(2 y log2 e) + 1), one ex2 and one fast division
// where tanhf's branches and an IEEE division cost several times more in the score loop.  |y|
// is clamped to 10 (tanh(10) rounds to 1 in float32) with comparisons, so NaN passes through.
// The absolute error of tanh is a few float32 ulps of 1 (the cancellation near 0), far below
// the 16-bit rounding of the results; forward and backward recompute the same values.
__device__ __forceinline__ float sk_softcap_log2(float x, float softcap, float inv_cap) {
    float y = x * inv_cap;
    y = y > 10.0f ? 10.0f : (y < -10.0f ? -10.0f : y);
    const float t = 1.0f - __fdividef(2.0f, sk_ex2(y * (2.0f * 1.4426950408889634f)) + 1.0f);
    return softcap * t * 1.4426950408889634f;
}

template <bool PRECISE> __device__ __forceinline__ float sk_log(float v) {
    if (PRECISE) return logf(v);
    return __logf(v);
}

// Merge summary (m2, s2) into (m, s): the larger maximum wins and the other side is rescaled.
// Equal maxima (both -inf for empty sides) add directly, so -inf - -inf is never evaluated.
template <bool PRECISE>
__device__ __forceinline__ void sk_merge(float& m, float& s, float m2, float s2) {
    if (m2 > m) {
        s = s * sk_exp<PRECISE>(m - m2) + s2;
        m = m2;
    } else if (m2 < m) {
        s += s2 * sk_exp<PRECISE>(m2 - m);
    } else {
        s += s2;
    }
}

// logsumexp's summary (m, t) with t = S - 1, the sum without one instance of the maximum, so
// that a row dominated by one term keeps the others' share (log1p at the end; spec
// "logsumexp").  The empty summary is (-inf, -1); equal maxima (both -inf for empty sides)
// take the last branch, so -inf - -inf is never evaluated.
template <bool PRECISE>
__device__ __forceinline__ void sk_merge_rest(float& m, float& t, float m2, float t2) {
    if (m2 > m) {
        t = (t + 1.0f) * sk_exp<PRECISE>(m - m2) + t2;
        m = m2;
    } else if (m2 < m) {
        t += (t2 + 1.0f) * sk_exp<PRECISE>(m2 - m);
    } else {
        t += t2 + 1.0f;
    }
}

// Thread-block clusters (sm_90 and newer): rank, barrier halves, and loads from a peer's shared
// memory.  Older devices have none: there the kernels build without a cluster shape and these
// operations trap, and the adapters never launch a kernel of CLUSTER > 1 on such a device
// (configs.row_configs without clusters).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define SK_CLUSTERS 1
#define SK_CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)
#else
#define SK_CLUSTERS 0
#define SK_CLUSTER_DIMS(n)
#endif
__device__ __forceinline__ unsigned sk_cluster_rank() {
#if SK_CLUSTERS
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    __trap();
    return 0u;
#endif
}
__device__ __forceinline__ void sk_cluster_arrive() {
#if SK_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void sk_cluster_wait() {
#if SK_CLUSTERS
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ float sk_cluster_load(const float* smem, unsigned rank) {
#if SK_CLUSTERS
    unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    __trap();
    return 0.0f;
#endif
}
