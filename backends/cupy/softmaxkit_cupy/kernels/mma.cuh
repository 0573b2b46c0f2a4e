// Tensor-core building blocks in inline PTX (NVRTC on the device has no <mma.h>):
// asynchronous 16-byte copies into swizzled shared-memory tiles, ldmatrix, and
// mma.sync.m16n8k16 with float32 accumulation for bfloat16 and float16 operands.
//
// Fragment layout of m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, 4 regs of 2 values): (g, 2t) (g+8, 2t) (g, 2t+8) (g+8, 2t+8)
//   B (16x8, 2 regs):              (k=2t, n=g) (k=2t+8, n=g)
//   C (16x8, 4 floats):            (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1)
#pragma once
#include "common.cuh"

__device__ __forceinline__ void sk_cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int bytes = valid ? 16 : 0;  // 0 source bytes: the 16 destination bytes become 0
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(bytes)
                 : "memory");
}
// p[0] += a, p[1] += b in global memory: one vector reduction from sm_90, two before.
__device__ __forceinline__ void sk_red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}
__device__ __forceinline__ void sk_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void sk_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void sk_ldmatrix_x4(unsigned (&r)[4], const void* smem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void sk_ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

template <typename T> struct SkMma;
template <> struct SkMma<sk_bf16> {
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4],
                                               unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&v);
    }
};
template <> struct SkMma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4],
                                               unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&v);
    }
};

// A [rows x D] tile of 16-bit values in shared memory, row-major with the 16-byte chunks of
// row r permuted by c ^ (r % 8), so the eight rows one ldmatrix reads hit distinct banks.
// Rows of fewer than eight chunks (D < 64) share a 128-byte line with their neighbours, so
// the permutation follows the line index instead.  Rows of 8 k + 2 or 8 k + 4 chunks (D = 80,
// 96, 160) permute their aligned groups of eight chunks by c ^ (r % 8) and their tail group
// of 2 or 4 as a row of D < 64 would: each row stays in place and the eight rows of a column
// still hit distinct banks (rows start 2 or 4 chunks past a 128-byte line in turn).
template <int D> __device__ __forceinline__ int sk_swz(int r, int col) {
    constexpr int CH = D / 8;
    constexpr int FULL = CH & ~7, TAIL = CH & 7;
    static_assert(TAIL == 0 || TAIL == 2 || TAIL == 4 || (FULL == 0 && (CH & (CH - 1)) == 0),
                  "rows of 8 k, 8 k + 2, 8 k + 4 or 1, 2, 4 16-byte chunks");
    if constexpr (FULL > 0 && TAIL > 0) {
        const int perm = (col >> 3) < FULL ? (r & 7) : ((r / (8 / TAIL)) & (TAIL - 1));
        return r * D + ((((col >> 3) ^ perm)) << 3) + (col & 7);
    }
    const int perm = CH >= 8 ? (r & 7) : ((r / (8 / CH)) & (CH - 1));
    return r * D + ((((col >> 3) ^ perm)) << 3) + (col & 7);
}

// Copy rows [0, ROWS) of a tile (row stride ld elements) into shared memory; rows at or
// past `valid` are zero-filled.  All THREADS threads take part.
template <typename T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void sk_load_tile(T* smem, const T* g, long long ld, int valid) {
    constexpr int CHUNKS = D / 8;
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, ch = c % CHUNKS;
        const bool ok = r < valid;
        const T* src = g + static_cast<long long>(ok ? r : 0) * ld + ch * 8;
        sk_cp_async16(smem + sk_swz<D>(r, ch * 8), src, ok);
    }
}

// Copy rows [0, ROWS) of a float32 tile (row stride ld elements) into shared memory as rows
// of PW floats (D + 4 unless given), unswizzled; rows at or past `valid` are zero-filled.
// All THREADS threads take part.  D and PW are multiples of 4 and the source rows are 16-byte
// aligned.
template <int ROWS, int D, int THREADS, int PW = D + 4>
__device__ __forceinline__ void sk_load_padded(float* smem, const float* g, long long ld,
                                               int valid) {
    constexpr int CHUNKS = D / 4;
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, ch = c % CHUNKS;
        const bool ok = r < valid;
        sk_cp_async16(smem + r * PW + ch * 4, g + (ok ? r : 0) * ld + ch * 4, ok);
    }
}

// The fragments an m16n8k16 product takes from a swizzled tile of width W, each the 16 x 16
// block at rows r0.., columns c0.. as ldmatrix's four 8 x 8 matrices:
//   SK_A   A (rows m, columns k) of an [m x k] tile (e.g. queries);
//   SK_B   B of two n-blocks, b[0], b[1] for rows r0..r0+7 and b[2], b[3] for rows
//          r0+8..r0+15, of an [n x k] tile (e.g. keys);
//   SK_AT  A (rows m0 = c0.., columns k0 = r0..) of a matrix stored transposed, as a [k x m]
//          tile, through the transposing ldmatrix (e.g. dS from a tile of dS^T);
//   SK_BT  B of two n-blocks (columns c0..c0+15) of a [k x n] tile (e.g. values), through the
//          transposing ldmatrix.
// A and BT take the four matrices down the columns first, B and AT along the rows.
enum SkFrag { SK_A, SK_B, SK_AT, SK_BT };

template <SkFrag F, int W>
__device__ __forceinline__ void sk_frag(unsigned (&f)[4], const void* tile, int r0, int c0) {
    constexpr bool down = F == SK_A || F == SK_BT;
    const int lane = threadIdx.x & 31;
    const int lo = (lane >> 3) & 1, hi = lane >> 4;  // the matrix this lane addresses a row of
    const int r = r0 + (lane & 7) + (down ? lo : hi) * 8;
    const int c = c0 + (down ? hi : lo) * 8;
    const unsigned short* row = static_cast<const unsigned short*>(tile) + sk_swz<W>(r, c);
    if (F == SK_AT || F == SK_BT) {
        sk_ldmatrix_x4_trans(f, row);
    } else {
        sk_ldmatrix_x4(f, row);
    }
}

// c0 += a b and c1 += a b' for the two n-blocks b = (b[0], b[1]), b' = (b[2], b[3]) of one
// SK_B or SK_BT fragment.
template <typename T>
__device__ __forceinline__ void sk_mma_pair(float (&c0)[4], float (&c1)[4],
                                            const unsigned (&a)[4], const unsigned (&b)[4]) {
    SkMma<T>::run(c0, a, b[0], b[1]);
    SkMma<T>::run(c1, a, b[2], b[3]);
}

// c[nb] += A B^T over a head dimension D: A the warp's 16 rows of tile a from row a0, B the
// NB n-blocks of tile b ([n x D]).
template <typename T, int D, int NB>
__device__ __forceinline__ void sk_mma_abt(float (&c)[NB][4], const T* a, int a0, const T* b) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned af[4];
        sk_frag<SK_A, D>(af, a, a0, kk * 16);
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            unsigned bf[4];
            sk_frag<SK_B, D>(bf, b, nb * 8, kk * 16);
            sk_mma_pair<T>(c[nb], c[nb + 1], af, bf);
        }
    }
}

// A C accumulator's rows g and g + 8 scaled by f[0] and f[1] (an online softmax's rescale).
__device__ __forceinline__ void sk_scale_rows(float (&c)[4], const float (&f)[2]) {
    c[0] *= f[0];
    c[1] *= f[0];
    c[2] *= f[1];
    c[3] *= f[1];
}

// The A fragment (16 x 16) of two adjacent C accumulators (16 x 8 each) rounded to T: a
// product's result feeds the next product without leaving registers.
template <typename T>
__device__ __forceinline__ void sk_pack_a(unsigned (&a)[4], const float (&c0)[4],
                                          const float (&c1)[4]) {
    a[0] = SkMma<T>::pack(c0[0], c0[1]);
    a[1] = SkMma<T>::pack(c0[2], c0[3]);
    a[2] = SkMma<T>::pack(c1[0], c1[1]);
    a[3] = SkMma<T>::pack(c1[2], c1[3]);
}
