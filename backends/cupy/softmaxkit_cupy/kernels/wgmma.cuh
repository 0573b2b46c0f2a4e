// Warpgroup matrix products (sm_90a, inline PTX: NVRTC has no CUTLASS headers): shared-memory
// matrix descriptors, wgmma.mma_async with float32 accumulators, and the fences around it.
//
// Operand tiles in shared memory use the 128-byte swizzle: a tile of R rows and D columns
// (16-bit) is stored as D / 64 panels of 64 columns, panel p at p * R * 128 bytes, row r of a
// panel at r * 128 bytes with its 16-byte chunk c at (c ^ (r % 8)) * 16.  Panels start on
// 1024-byte boundaries, since the hardware applies the swizzle to address bits 4-6 from bits
// 7-9.  The same bytes serve as a K-major operand (rows = M or N, columns = K: Q, K) and as
// an MN-major one (rows = K, columns = N: V).  Panels of 32 columns have 64-byte rows under the
// 64-byte swizzle: chunk c of row r at (c ^ (r / 2 % 4)) * 16 (address bits 4-5 from bits
// 7-8), 8 rows every 512 bytes, panel p at p * R * 64 bytes.
//
// Accumulator layout of m64nNk16 (g = lane / 4, t = lane % 4, warp w of the warpgroup owns
// rows 16 w .. 16 w + 15): d[4 j + e] is row 16 w + g + 8 (e / 2), column 8 j + 2 t + (e % 2),
// the mma.sync C layout repeated over N / 8 column blocks.  A from registers (m64k16) has the
// mma.sync A layout per warp, so two adjacent accumulator blocks rounded to 16 bits are one
// A fragment (sk_pack_a in mma.cuh).
#pragma once
#include "common.cuh"
#include "mma.cuh"

// The descriptor of a swizzled operand starting at shared address `addr` (bytes): lbo and sbo
// in bytes, rows of `row_bytes` (128, or 64 for the 64-byte swizzle).  K-major: sbo = 8 rows
// (1024 bytes at 128), lbo unused (16).  MN-major: lbo = the distance between panels, sbo =
// the next 8 rows of K.
__device__ __forceinline__ unsigned long long sk_desc(unsigned addr, unsigned lbo, unsigned sbo,
                                                      int row_bytes = 128) {
    const unsigned long long mode = row_bytes == 128 ? 1ull : 2ull;  // the layout's swizzle
    return static_cast<unsigned long long>((addr & 0x3ffff) >> 4) |
           (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(sbo >> 4) << 32) | (mode << 62);
}

__device__ __forceinline__ void sk_wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void sk_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void sk_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (st.shared, cp.async) becomes visible to
// wgmma (the async proxy) after this fence and a barrier.
__device__ __forceinline__ void sk_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Registers an asynchronous product writes: ordinary code that reads or writes them stays on
// its side of the wait (the compiler sees each register redefined here).
template <int R> __device__ __forceinline__ void sk_fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R> __device__ __forceinline__ void sk_fence_regs(unsigned (&d)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}

#define SK_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define SK_F16(d, i) SK_F4(d, i), SK_F4(d, i + 4), SK_F4(d, i + 8), SK_F4(d, i + 12)
#define SK_F32(d) SK_F16(d, 0), SK_F16(d, 16)
#define SK_F64(d) SK_F32(d), SK_F16(d, 32), SK_F16(d, 48)
#define SK_F96(d) SK_F64(d), SK_F16(d, 64), SK_F16(d, 80)
#define SK_F128(d) SK_F64(d), SK_F16(d, 64), SK_F16(d, 80), SK_F16(d, 96), SK_F16(d, 112)

// D (m64 x N, float32) = A B (+ D when acc != 0).  ss: A and B from shared memory, both
// K-major.  rs: A from registers, B from shared memory MN-major (transposed).  The last
// argument picks the 16-bit input type.
template <int N> struct SkWgmma;
template <> struct SkWgmma<32> {
    static __device__ __forceinline__ void rs(float (&d)[16], const unsigned (&a)[4],
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "{%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"
            : SK_F16(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[16], const unsigned (&a)[4],
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "{%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"
            : SK_F16(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    // A and B both MN-major (A stored as K rows of M columns, B as K rows of N columns).
    static __device__ __forceinline__ void sst(float (&d)[16], unsigned long long a,
                                               unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "%16, %17, p, 1, 1, 1, 1;\n}\n"
            : SK_F16(d, 0) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void sst(float (&d)[16], unsigned long long a,
                                               unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
            "%16, %17, p, 1, 1, 1, 1;\n}\n"
            : SK_F16(d, 0) : "l"(a), "l"(b), "r"(acc));
    }
};
template <> struct SkWgmma<64> {
    static __device__ __forceinline__ void ss(float (&d)[32], unsigned long long a,
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 0, 0;\n}\n"
            : SK_F32(d) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[32], const unsigned (&a)[4],
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
            : SK_F32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void ss(float (&d)[32], unsigned long long a,
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 0, 0;\n}\n"
            : SK_F32(d) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[32], const unsigned (&a)[4],
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
            : SK_F32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    // A and B both MN-major (A stored as K rows of M columns, B as K rows of N columns).
    static __device__ __forceinline__ void sst(float (&d)[32], unsigned long long a,
                                               unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 1, 1;\n}\n"
            : SK_F32(d) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void sst(float (&d)[32], unsigned long long a,
                                               unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 1, 1;\n}\n"
            : SK_F32(d) : "l"(a), "l"(b), "r"(acc));
    }
};
template <> struct SkWgmma<96> {
    static __device__ __forceinline__ void rs(float (&d)[48], const unsigned (&a)[4],
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
            "{"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
            "}, "
            "{%48, %49, %50, %51}, %52, p, 1, 1, 1;\n}\n"
            : SK_F32(d), SK_F16(d, 32)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[48], const unsigned (&a)[4],
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 "
            "{"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
            "}, "
            "{%48, %49, %50, %51}, %52, p, 1, 1, 1;\n}\n"
            : SK_F32(d), SK_F16(d, 32)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    // A and B both MN-major (A stored as K rows of M columns, B as K rows of N columns).
    static __device__ __forceinline__ void sst(float (&d)[48], unsigned long long a,
                                               unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
            "{"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
            "}, "
            "%48, %49, p, 1, 1, 1, 1;\n}\n"
            : SK_F32(d), SK_F16(d, 32) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void sst(float (&d)[48], unsigned long long a,
                                               unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 "
            "{"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
            "}, "
            "%48, %49, p, 1, 1, 1, 1;\n}\n"
            : SK_F32(d), SK_F16(d, 32) : "l"(a), "l"(b), "r"(acc));
    }
};
template <> struct SkWgmma<128> {
    static __device__ __forceinline__ void ss(float (&d)[64], unsigned long long a,
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63}, "
            "%64, %65, p, 1, 1, 0, 0;\n}\n"
            : SK_F64(d) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[64], const unsigned (&a)[4],
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
            : SK_F64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void ss(float (&d)[64], unsigned long long a,
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63}, "
            "%64, %65, p, 1, 1, 0, 0;\n}\n"
            : SK_F64(d) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[64], const unsigned (&a)[4],
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
            : SK_F64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
};
template <> struct SkWgmma<192> {
    static __device__ __forceinline__ void rs(float (&d)[96], const unsigned (&a)[4],
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
            "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
            "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
            "{%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"
            : SK_F96(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[96], const unsigned (&a)[4],
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
            "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
            "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
            "{%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n"
            : SK_F96(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
};
template <> struct SkWgmma<256> {
    static __device__ __forceinline__ void ss(float (&d)[128], unsigned long long a,
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
            "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
            "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
            "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
            "%120, %121, %122, %123, %124, %125, %126, %127}, "
            "%128, %129, p, 1, 1, 0, 0;\n}\n"
            : SK_F128(d) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[128], const unsigned (&a)[4],
                                              unsigned long long b, int acc, sk_bf16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
            "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
            "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
            "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
            "%120, %121, %122, %123, %124, %125, %126, %127}, "
            "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
            : SK_F128(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void ss(float (&d)[128], unsigned long long a,
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
            "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
            "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
            "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
            "%120, %121, %122, %123, %124, %125, %126, %127}, "
            "%128, %129, p, 1, 1, 0, 0;\n}\n"
            : SK_F128(d) : "l"(a), "l"(b), "r"(acc));
    }
    static __device__ __forceinline__ void rs(float (&d)[128], const unsigned (&a)[4],
                                              unsigned long long b, int acc, __half) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
            "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
            "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
            "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
            "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
            "%120, %121, %122, %123, %124, %125, %126, %127}, "
            "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
            : SK_F128(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
    }
};

// The panel width of a tile a warpgroup reads COLS columns of: 64 where they are whole
// 64-column panels (the 128-byte swizzle), else 32 (the 64-byte one).
template <int COLS> constexpr int sk_panel_cols = COLS % 64 == 0 ? 64 : 32;

// Copy rows [0, ROWS) of a [rows x D] tile (row stride ld elements) into the swizzled panels
// of COLS columns described above (64: the 128-byte swizzle, 32: the 64-byte one); rows at or
// past `valid` are zero-filled.  All THREADS threads take part, thread `tid` (threadIdx.x: a
// caller in a loop may pass it through sk_opaque_tid, so that the addresses are computed at
// each copy rather than hoisted out and held in registers).
template <typename T, int ROWS, int D, int THREADS, int COLS = 64>
__device__ __forceinline__ void sk_load_panels(T* smem, const T* g, long long ld, int valid,
                                               int tid) {
    constexpr int CHUNKS = D / 8;
    constexpr int PC = COLS / 8;  // chunks of a panel's row
    static_assert((COLS == 64 || COLS == 32) && D % COLS == 0, "whole panels");
    static_assert(ROWS * CHUNKS % THREADS == 0, "whole steps of the tile's chunks");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int c = tid + i * THREADS;
        const int r = c / CHUNKS, ch = c % CHUNKS;
        const bool ok = r < valid;
        const T* src = g + static_cast<long long>(ok ? r : 0) * ld + ch * 8;
        const int swz = PC == 8 ? (r & 7) : ((r >> 1) & 3);
        T* dst = smem + (ch / PC) * ROWS * (PC * 8) + r * (PC * 8) + (((ch % PC) ^ swz) * 8);
        sk_cp_async16(dst, src, ok);
    }
}
template <typename T, int ROWS, int D, int THREADS, int COLS = 64>
__device__ __forceinline__ void sk_load_panels(T* smem, const T* g, long long ld, int valid) {
    sk_load_panels<T, ROWS, D, THREADS, COLS>(smem, g, ld, valid,
                                              static_cast<int>(threadIdx.x));
}

// threadIdx.x, as a value the compiler cannot see is the same at each call
__device__ __forceinline__ int sk_opaque_tid() {
    int tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return tid;
}
