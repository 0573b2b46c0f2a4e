// The host meaning of the device functions the kernels write in PTX (tests/conftest.py takes
// their definitions out of the source and includes this instead): the functions of
// HOST_PRIMITIVES, and the class template specializations of HOST_SPECIALIZATIONS (SkMma<T>,
// the 16-bit mma.sync of kernels/mma.cuh, and SkWgmma<N>, the warpgroup products of
// kernels/wgmma.cuh), taken out whole and defined here.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <deque>

// cp.async of 16 bytes, asynchronous as the device may make it at either extreme: the
// destination turns NaN when the copy is issued (as if it landed at once, over data other
// threads may still read) and takes the source's bytes only when a wait_group of this thread
// completes its group (as if it landed as late as it may), so a read on the wrong side of a
// barrier or a wait sees NaN.  0 source bytes (not valid) zero the destination.
struct sk_host_copy {
    void* smem;
    const void* gmem;
    bool valid;
};
// A thread's copies: those not yet committed, and the committed groups not yet waited for.
struct sk_host_copies {
    std::vector<sk_host_copy> open;
    std::deque<std::vector<sk_host_copy>> groups;
};

inline void sk_cp_async16(void* smem, const void* gmem, bool valid) {
    const float nan = std::nanf("");
    for (int i = 0; i < 4; ++i) std::memcpy(static_cast<char*>(smem) + 4 * i, &nan, 4);
    sk_host_local<sk_host_copies>().open.push_back({smem, gmem, valid});
}
inline void sk_cp_async_commit() {
    sk_host_copies& mine = sk_host_local<sk_host_copies>();
    mine.groups.push_back(std::move(mine.open));
    mine.open.clear();
}
template <int N> inline void sk_cp_async_wait() {
    std::deque<std::vector<sk_host_copy>>& groups = sk_host_local<sk_host_copies>().groups;
    while (groups.size() > static_cast<std::size_t>(N)) {
        for (const sk_host_copy& c : groups.front()) {
            if (c.valid)
                std::memcpy(c.smem, c.gmem, 16);
            else
                std::memset(c.smem, 0, 16);
        }
        groups.pop_front();
    }
}

// ex2.approx.ftz.f32: 2^x with results below the normal range flushed to +0.
inline float sk_ex2(float x) {
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

// red.global.add.v2.f32 (sm_90; two atomicAdd before): p[0] += a and p[1] += b, each element
// added atomically, as two atomicAdd (the host build never takes the PTX branch, which this
// replaces so that both branches mean the same here).
inline void sk_red_add2(float* p, float a, float b) {
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}

// --- TF32 tensor cores (kernels/attention_tf32.cu, kernels/mma.cuh) ----------------------------
//
// The warp-collective primitives exchange their operands through a staging area of 16 words a
// thread of the block running now (a lane's slot in emulation.h holds 8 bytes; an mma takes
// 40): each lane publishes its part, the warp meets (__syncwarp), and each lane reads what it
// receives.  The collectives use two such areas in turn (sk_host_stage), so one barrier each
// suffices: a lane publishes into an area again only after the barrier of the collective in
// between, which every lane reaches after its reads of the area (the lanes of a warp run the
// same collectives in the same order, so they agree on the turn).  Since every lane must
// reach the barrier, a collective that a lane skips deadlocks here (the device's .aligned
// makes it undefined).  Layouts are the PTX ISA's ("Matrix Fragments for mma.m16n8k8",
// "Warp-level matrix load instruction: ldmatrix"); g = lane / 4, t = lane % 4.
alignas(16) inline std::uint32_t sk_host_stages[2][1024][16];
struct sk_host_turn {
    unsigned parity = 0;  // this lane's collectives so far, mod 2
};
inline std::uint32_t (&sk_host_stage())[1024][16] {
    unsigned& parity = sk_host_local<sk_host_turn>().parity;
    parity ^= 1u;
    return sk_host_stages[parity];
}

// cvt.rna.tf32.f32: x rounded to TF32 (10 explicit mantissa bits) to nearest, ties away from
// zero, as a .b32 whose low 13 bits are 0.  A finite x takes half a TF32 ulp (0x1000) on its
// magnitude bits and drops the low 13, which rounds subnormals too and carries into the
// exponent (up to inf past the largest TF32); inf and NaN are only masked, as ptxas lowers it
// (|x| >= inf or unordered skips the addition), so they stay inf and NaN (a NaN whose payload
// lies only in the low 13 bits would become inf; the kernels make none).
inline unsigned sk_tf32(float x) {
    unsigned u = __float_as_uint(x);
    if (std::isfinite(x)) u += 0x1000u;
    return u & 0xffffe000u;
}

// A float32 rounded toward zero from a double (the tensor cores truncate their float32 sums).
inline float sk_host_f32_toward_zero(double s) {
    float f = static_cast<float>(s);  // to nearest
    if (std::isfinite(s) && std::fabs(static_cast<double>(f)) > std::fabs(s))
        f = std::nextafter(f, 0.0f);
    return f;
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, D = A B + C in place of C, for the warp:
//   A [16 x 8]: a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4];
//   B [8 x 8]:  b0 = B[t][g], b1 = B[t + 4][g];
//   C, D [16 x 8]: c0 = C[g][2t], c1 = C[g][2t + 1], c2 = C[g + 8][2t], c3 = C[g + 8][2t + 1].
// Each operand is read as TF32 (the top 19 bits of its register; the low 13 are ignored, as the
// tensor cores ignore them).  Emulated in double: the products are exact (11-bit significands),
// the eight products and C are summed in double and the sum is rounded once toward zero to
// float32.  The device sums in float32 with truncation, step by step, so its result may lie
// further from the exact one than this emulation's; inf and NaN propagate as in IEEE
// arithmetic (inf * 0 is NaN).
// The warp's D = A B + C of m16n8 tiles K deep (the registers a, b0, b1, c in the layouts
// above): each lane publishes its registers, and element(word, k) reads element k of a
// register as a double; the K products and C are summed in double and the sum is rounded
// once toward zero to float32.
template <unsigned K, typename Element>
inline void sk_host_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                        Element element) {
    const unsigned me = threadIdx.x, base = me & ~31u, lane = me & 31u;
    const unsigned g = lane / 4, t = lane % 4;
    constexpr unsigned H = K / 2;  // k at or past H: the second register of a row's pair
    constexpr unsigned P = K / 8;  // consecutive k a register holds
    auto& stage = sk_host_stage();
    std::uint32_t* mine = stage[me];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    for (int i = 0; i < 4; ++i) mine[6 + i] = __float_as_uint(c[i]);
    __syncwarp();
    auto A = [&](unsigned r, unsigned k) {  // held by lane 4 (r % 8) + (k % H) / P
        return element(stage[base + 4 * (r % 8) + (k % H) / P][(r >= 8) + 2 * (k >= H)], k);
    };
    auto B = [&](unsigned k, unsigned n) {  // held by lane 4 n + (k % H) / P
        return element(stage[base + 4 * n + (k % H) / P][4 + (k >= H)], k);
    };
    auto C = [&](unsigned r, unsigned n) {  // held by lane 4 (r % 8) + n / 2
        return __uint_as_float(stage[base + 4 * (r % 8) + n / 2][6 + n % 2 + 2 * (r >= 8)]);
    };
    float d[4];
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned r = g + 8 * (i / 2), n = 2 * t + i % 2;
        double s = C(r, n);
        for (unsigned k = 0; k < K; ++k) s += A(r, k) * B(k, n);
        d[i] = sk_host_f32_toward_zero(s);
    }
    for (int i = 0; i < 4; ++i) c[i] = d[i];
}

inline void sk_mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    sk_host_mma<8>(c, a, b0, b1, [](std::uint32_t bits, unsigned) {
        return static_cast<double>(__uint_as_float(bits & 0xffffe000u));
    });
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: four 8 x 8 matrices of 16-bit elements,
// lanes 8 i .. 8 i + 7 giving the addresses of rows 0..7 of matrix i (16-byte aligned, in the
// block's shared memory, else abort).  Lane l receives in r[i] the 32-bit word of elements
// 2 (l % 4) (low half) and 2 (l % 4) + 1 (high half) of row l / 4 of matrix i; with .trans, of
// the transposed matrix: elements l / 4 of rows 2 (l % 4) (low half) and 2 (l % 4) + 1.
template <bool TRANS> inline void sk_host_ldmatrix_x4(unsigned (&r)[4], const void* smem) {
    const unsigned me = threadIdx.x, base = me & ~31u, lane = me & 31u;
    const auto at = reinterpret_cast<std::uintptr_t>(smem);
    const auto lo = reinterpret_cast<std::uintptr_t>(sk_smem);
    if (at % 16 != 0 || at < lo || at + 16 > lo + sizeof(sk_smem)) std::abort();
    auto& stage = sk_host_stage();
    std::memcpy(stage[me], &at, sizeof at);
    __syncwarp();
    auto row = [&](unsigned m, unsigned i) {  // row i of matrix m
        std::uintptr_t p;
        std::memcpy(&p, stage[base + 8 * m + i], sizeof p);
        return reinterpret_cast<const unsigned char*>(p);
    };
    unsigned out[4];
    for (unsigned m = 0; m < 4; ++m) {
        if (TRANS) {
            std::uint16_t low, high;
            std::memcpy(&low, row(m, 2 * (lane % 4)) + 2 * (lane / 4), 2);
            std::memcpy(&high, row(m, 2 * (lane % 4) + 1) + 2 * (lane / 4), 2);
            out[m] = low | static_cast<unsigned>(high) << 16;
        } else {
            std::memcpy(&out[m], row(m, lane / 4) + 4 * (lane % 4), 4);
        }
    }
    for (int i = 0; i < 4; ++i) r[i] = out[i];
}
inline void sk_ldmatrix_x4(unsigned (&r)[4], const void* smem) {
    sk_host_ldmatrix_x4<false>(r, smem);
}
inline void sk_ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
    sk_host_ldmatrix_x4<true>(r, smem);
}

// --- 16-bit tensor cores (kernels/attention.cu, kernels/attention_bwd.cu, kernels/mma.cuh) ----
//
// SkMma<T>::run, mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32 (T bf16 or f16), D = A B + C in
// place of C, for the warp; each 32-bit A and B register holds two 16-bit elements, the first
// in its low half (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"):
//   A [16 x 16]: a[0] = A[g][2t, 2t + 1], a[1] = A[g + 8][2t, 2t + 1],
//                a[2] = A[g][2t + 8, 2t + 9], a[3] = A[g + 8][2t + 8, 2t + 9];
//   B [16 x 8]:  b0 = B[2t, 2t + 1][g], b1 = B[2t + 8, 2t + 9][g];
//   C, D [16 x 8]: c0 = C[g][2t], c1 = C[g][2t + 1], c2 = C[g + 8][2t], c3 = C[g + 8][2t + 1].
// Emulated in double: the products of two 16-bit values are exact (8- or 11-bit significands,
// so exact in float32 too), the sixteen products and C are summed in double (exact but for
// terms of widely different exponents) and the sum is rounded once toward zero to float32, as
// the TF32 emulation does (sk_mma_tf32).  The device sums in float32 with truncation, step by
// step, so its result may lie further from the exact one than this emulation's; inf and NaN
// propagate as in IEEE arithmetic.  SkMma<T>::pack rounds two floats to T (to nearest even)
// into one register, the first in the low half, as kernels/mma.cuh does.
template <double (*WIDEN)(std::uint16_t)>
inline void sk_host_mma_m16n8k16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                 unsigned b1) {
    sk_host_mma<16>(c, a, b0, b1, [](std::uint32_t word, unsigned k) {  // its half k % 2
        return WIDEN(static_cast<std::uint16_t>(k % 2 ? word >> 16 : word & 0xffffu));
    });
}
inline double sk_host_widen_bf16(std::uint16_t bits) {
    return __bfloat162float(__nv_bfloat16{bits});
}
inline double sk_host_widen_f16(std::uint16_t bits) { return __half2float(__half{bits}); }

// SkMma<T> of kernels/mma.cuh for T whose bits WIDEN reads and whose pairs PAIR rounds two
// floats to (the first in the low half).
template <double (*WIDEN)(std::uint16_t), typename Pair, Pair (*PAIR)(float, float)>
struct sk_host_mma16 {
    static void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        sk_host_mma_m16n8k16<WIDEN>(d, a, b0, b1);
    }
    static unsigned pack(float lo, float hi) {
        const Pair v = PAIR(lo, hi);
        unsigned r;
        std::memcpy(&r, &v, 4);
        return r;
    }
};
template <typename T> struct SkMma;
template <> struct SkMma<__nv_bfloat16>
    : sk_host_mma16<sk_host_widen_bf16, __nv_bfloat162, __floats2bfloat162_rn> {};
template <> struct SkMma<__half> : sk_host_mma16<sk_host_widen_f16, __half2, __floats2half2_rn> {};

// --- Warpgroup matrix products (kernels/wgmma.cuh: the Hopper kernels, sm_90a) --------------
//
// The Hopper kernels name their dynamic shared memory sk_smem_raw and read its address as 0
// (emulation.h's __cvta_generic_to_shared), so a descriptor's addresses are offsets into
// sk_smem.  wgmma.mma_async runs when issued, each thread computing its own accumulator
// elements, d[4 j + e] = D[16 w + g + 8 (e / 2)][8 j + 2 t + e % 2] (w the warp of its
// warpgroup), from the operands in shared memory read through their descriptors, or, for A
// from registers, from its warp's A fragments (the mma.sync layout above, exchanged as
// SkMma's are): the fences, commits and waits have nothing left to order, and a product that
// reads shared memory before the barrier or cp.async wait that fills it sees NaN.  Sums as
// SkMma's: the sixteen exact products and D in double, rounded once toward zero to float32.
#define sk_smem_raw sk_smem
inline void sk_wgmma_fence() {}
inline void sk_wgmma_commit() {}
template <int N> inline void sk_wgmma_wait() {}
inline void sk_fence_proxy_async() {}
template <int R> inline void sk_fence_regs(float (&)[R]) {}
template <int R> inline void sk_fence_regs(unsigned (&)[R][4]) {}
inline int sk_opaque_tid() { return static_cast<int>(threadIdx.x); }

// The byte offset in shared memory of element (r, c) of the operand `desc` describes (bits
// 0-13 the start address, 16-29 the leading and 32-45 the stride byte offset, all in 16-byte
// units; 62-63 the swizzle: 1 for 128-byte rows, 2 for 64-byte rows).  K-major (r an M or N
// index, c a k < 16): rows of 8-row groups sbo apart; MN-major (r a k, c an M or N index):
// the same rows, of rb / 2 columns a panel, panels lbo apart.  The swizzle XORs the 16-byte
// chunk (address bits 4-6, or 4-5) with the row within its 1024- or 512-byte atom (bits 7-9,
// or 7-8), of the address the offsets give.
inline unsigned sk_host_operand(unsigned long long desc, unsigned r, unsigned c,
                                bool mn_major) {
    const unsigned start = static_cast<unsigned>(desc & 0x3fffu) << 4;
    const unsigned lbo = static_cast<unsigned>((desc >> 16) & 0x3fffu) << 4;
    const unsigned sbo = static_cast<unsigned>((desc >> 32) & 0x3fffu) << 4;
    const unsigned mode = static_cast<unsigned>(desc >> 62);
    if (mode != 1 && mode != 2) std::abort();  // the kernels use these two
    const unsigned rb = mode == 1 ? 128u : 64u, cols = rb / 2;
    const unsigned a = mn_major
        ? start + (c / cols) * lbo + (r / 8) * sbo + (r % 8) * rb + (c % cols) * 2
        : start + (r / 8) * sbo + (r % 8) * rb + c * 2;
    return a ^ (((a >> 7) & (mode == 1 ? 7u : 3u)) << 4);
}
// The value of 16-bit `bits` of the type of the tag (bfloat16 or float16).
inline double sk_host_widen(std::uint16_t bits, __nv_bfloat16) {
    return sk_host_widen_bf16(bits);
}
inline double sk_host_widen(std::uint16_t bits, __half) { return sk_host_widen_f16(bits); }
// The element of 16-bit type T at (r, c) of the operand `desc` describes, as a double.
template <typename T>
inline double sk_host_operand_value(unsigned long long desc, unsigned r, unsigned c,
                                    bool mn_major) {
    std::uint16_t bits;
    std::memcpy(&bits, sk_smem + sk_host_operand(desc, r, c, mn_major), 2);
    return sk_host_widen(bits, T());
}

// D (64 x N) = A B (+ D where acc), A [64 x 16] by A(m, k), B [16 x N] by B(k, n).
template <int N, typename AOf, typename BOf>
inline void sk_host_wgmma(float (&d)[N / 2], int acc, AOf A, BOf B) {
    const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const unsigned w = (threadIdx.x / 32) % 4;
    float out[N / 2];
    for (unsigned j = 0; j < N / 8; ++j)
        for (unsigned e = 0; e < 4; ++e) {
            const unsigned m = 16 * w + g + 8 * (e / 2), n = 8 * j + 2 * t + e % 2;
            double s = acc ? d[4 * j + e] : 0.0;
            for (unsigned k = 0; k < 16; ++k) s += A(m, k) * B(k, n);
            out[4 * j + e] = sk_host_f32_toward_zero(s);
        }
    for (int i = 0; i < N / 2; ++i) d[i] = out[i];
}
// SkWgmma<N> of kernels/wgmma.cuh, the 16-bit input type T picked by the last argument.
template <int N> struct sk_host_wgmma_n {
    // both from shared memory, K-major
    template <typename T> static void ss(float (&d)[N / 2], unsigned long long a,
                                         unsigned long long b, int acc, T) {
        sk_host_wgmma<N>(
            d, acc,
            [&](unsigned m, unsigned k) { return sk_host_operand_value<T>(a, m, k, false); },
            [&](unsigned k, unsigned n) { return sk_host_operand_value<T>(b, n, k, false); });
    }
    // both from shared memory, MN-major
    template <typename T> static void sst(float (&d)[N / 2], unsigned long long a,
                                          unsigned long long b, int acc, T) {
        sk_host_wgmma<N>(
            d, acc,
            [&](unsigned m, unsigned k) { return sk_host_operand_value<T>(a, k, m, true); },
            [&](unsigned k, unsigned n) { return sk_host_operand_value<T>(b, k, n, true); });
    }
    // A from the warp's registers (each lane's a[4] published to its slot), B MN-major
    template <typename T> static void rs(float (&d)[N / 2], const unsigned (&a)[4],
                                         unsigned long long b, int acc, T) {
        const unsigned me = threadIdx.x, base = me & ~31u;
        auto& stage = sk_host_stage();
        for (int i = 0; i < 4; ++i) stage[me][i] = a[i];
        __syncwarp();
        sk_host_wgmma<N>(
            d, acc,
            [&](unsigned m, unsigned k) {  // row m % 16 of the warp's, held by lane
                // 4 (m % 8) + (k % 8) / 2
                const unsigned r = m % 16;
                const std::uint32_t word =
                    stage[base + 4 * (r % 8) + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)];
                return sk_host_widen(
                    static_cast<std::uint16_t>(k % 2 ? word >> 16 : word & 0xffffu), T());
            },
            [&](unsigned k, unsigned n) { return sk_host_operand_value<T>(b, k, n, true); });
    }
};
template <int N> struct SkWgmma;
template <> struct SkWgmma<32> : sk_host_wgmma_n<32> {};
template <> struct SkWgmma<64> : sk_host_wgmma_n<64> {};
template <> struct SkWgmma<96> : sk_host_wgmma_n<96> {};
template <> struct SkWgmma<128> : sk_host_wgmma_n<128> {};
template <> struct SkWgmma<192> : sk_host_wgmma_n<192> {};
template <> struct SkWgmma<256> : sk_host_wgmma_n<256> {};

inline void sk_host_end_thread() {
    sk_host_local<sk_host_turn>() = {};
    sk_host_local<sk_host_copies>() = {};
}
