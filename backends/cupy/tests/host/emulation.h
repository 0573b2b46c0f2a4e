// CUDA C++ on the host, for the tests: a kernel's source compiles with g++ and runs one
// block at a time, each of its threads a fiber (a ucontext of its own stack) on the calling
// thread, so its indexing, tiling, exclusions and online softmax are checked against float64
// on a machine without a GPU.
//
// A fiber runs until it meets a barrier, then the next ready fiber runs: __syncthreads and
// __syncwarp are barriers, whose last thread to arrive makes the others ready again (in the
// order they arrived at one barrier, the reverse at the next, so that the threads of a phase do
// not always run in one order; and, in every other phase between the block's barriers, ahead of
// the threads already ready, so that one warp runs on to the block's next barrier before the
// other warps pass their first warp barrier); a warp shuffle is a store, a barrier, a load and
// a barrier.  Threads that all wait with none ready (a barrier some thread skips) abort the
// launch with a message, where the device would hang.  The block's dynamic shared memory is one
// buffer, filled with NaN before each block, so a read of anything not written first shows.
// Primitives written in PTX are replaced by their host meaning (tests/host/primitives.h):
// cp.async poisons its destination when issued and copies when its group is waited for, so a
// read on the wrong side of a wait or a barrier sees NaN; ex2.approx is exp2f; cvt.rna.tf32,
// the TF32 and 16-bit (bfloat16, float16) mma.sync and ldmatrix take the PTX ISA's roundings
// and fragment layouts, the warp's lanes exchanging their operands.  What this cannot show:
// timing, bank conflicts, the tensor cores' own rounding of their sums, and orders of the
// threads between barriers other than those taken.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __restrict__ __restrict
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct sk_host_dim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline sk_host_dim3 threadIdx, blockIdx;  // the running fiber's
inline sk_host_dim3 gridDim, blockDim;

struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
    float x, y;
};
struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __logf(float x) { return std::log(x); }
inline float __expf(float x) { return std::exp(x); }
inline unsigned __cvta_generic_to_shared(const void*) { return 0u; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
[[noreturn]] inline void __trap() { std::abort(); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

// A barrier of `expected` threads and those of them waiting at it.
struct sk_host_barrier {
    unsigned expected = 0, arrived = 0;
    std::vector<unsigned> waiting;
};

// The block running now (one at a time): its threads, their stacks, the ready ones in the
// order they run, the barriers and the warps' exchange slots.
struct sk_host_block {
    static constexpr std::size_t stack_bytes = 1 << 20;  // touched only as far as used
    const std::function<void()>* kernel = nullptr;
    std::vector<ucontext_t> threads;
    std::vector<std::unique_ptr<char[]>> stacks;
    std::deque<unsigned> ready;
    ucontext_t scheduler;
    unsigned running = 0, finished = 0;
    unsigned long releases = 0, phases = 0;
    sk_host_barrier block;
    std::vector<sk_host_barrier> warps;
    std::vector<unsigned long long> slots;
    explicit sk_host_block(unsigned count) : threads(count), block{count}, slots(count) {
        for (unsigned t = 0; t < count; ++t)
            stacks.push_back(std::unique_ptr<char[]>(new char[stack_bytes]));
        for (unsigned w = 0; w < (count + 31) / 32; ++w)
            warps.push_back({count - 32 * w < 32 ? count - 32 * w : 32});
    }
};
inline sk_host_block* sk_host_current = nullptr;

// The running thread arrives at `b`: the last to arrive makes the others ready and goes on;
// the others give way until then.
inline void sk_host_arrive(sk_host_barrier& b) {
    sk_host_block& blk = *sk_host_current;
    if (++b.arrived < b.expected) {
        b.waiting.push_back(blk.running);
        swapcontext(&blk.threads[blk.running], &blk.scheduler);
        return;
    }
    if (blk.releases++ % 2) std::reverse(b.waiting.begin(), b.waiting.end());
    // a warp's barrier makes its threads ready first in every other phase between the block's
    // barriers (odd phases in one block, even ones in the next, so that a loop of two barriers
    // has both), so that one warp runs ahead of the others to the block's next barrier
    const bool ahead = &b != &blk.block && blk.phases % 2;
    if (&b == &blk.block) ++blk.phases;
    blk.ready.insert(ahead ? blk.ready.begin() : blk.ready.end(), b.waiting.begin(),
                     b.waiting.end());
    b.waiting.clear();
    b.arrived = 0;
}

inline void __syncthreads() { sk_host_arrive(sk_host_current->block); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    sk_host_arrive(sk_host_current->warps[threadIdx.x / 32]);
}
template <typename T> inline T sk_host_shuffle(T v, unsigned from) {
    static_assert(sizeof(T) <= 8, "one slot a lane");
    const unsigned me = threadIdx.x, base = me & ~31u;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    sk_host_current->slots[me] = bits;
    __syncwarp();
    bits = sk_host_current->slots[base + (from & 31u)];
    __syncwarp();
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
inline unsigned __ballot_sync(unsigned, int predicate) {
    const unsigned me = threadIdx.x, base = me & ~31u;
    auto& slots = sk_host_current->slots;
    slots[me] = predicate != 0;
    __syncwarp();
    unsigned word = 0;
    for (unsigned l = 0; l < 32 && base + l < slots.size(); ++l)
        word |= static_cast<unsigned>(slots[base + l] != 0) << l;
    __syncwarp();
    return word;
}
inline int __any_sync(unsigned mask, int predicate) {
    return __ballot_sync(mask, predicate) != 0;
}
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask) {
    return sk_host_shuffle(v, (threadIdx.x & 31u) ^ static_cast<unsigned>(mask));
}
template <typename T> inline T __shfl_sync(unsigned, T v, int lane) {
    return sk_host_shuffle(v, static_cast<unsigned>(lane));
}

// The dynamic shared memory of the block running now (the kernels name it sk_smem).
alignas(16) inline unsigned char sk_smem[256 * 1024];

// State each thread keeps of its own through a launch (what primitives.h's cp.async groups and
// collective turns need): one T a thread of the block, fresh at each launch.
inline unsigned long sk_host_launches = 0;
template <typename T> inline T& sk_host_local() {
    static std::vector<T> slots;
    static unsigned long launch = 0;
    if (launch != sk_host_launches) {
        slots.assign(blockDim.x, T{});
        launch = sk_host_launches;
    }
    return slots[threadIdx.x];
}

// Called as each thread ends: a hook primitives.h defines (copies left pending are dropped).
inline void sk_host_end_thread();

inline void sk_host_thread_main() {
    sk_host_block& blk = *sk_host_current;
    (*blk.kernel)();
    sk_host_end_thread();
    ++blk.finished;  // and back to the scheduler, the context's successor
}

// Run `kernel` (a callable of no arguments) over a grid of blocks of `threads` threads, the
// blocks in order.  The shared memory is NaN at the launch, and the block's `shared` bytes
// are NaN again before each block.
inline void sk_host_launch(sk_host_dim3 grid, unsigned threads, std::size_t shared,
                           const std::function<void()>& kernel) {
    if (shared > sizeof(sk_smem)) std::abort();
    gridDim = grid;
    blockDim = {threads, 1, 1};
    ++sk_host_launches;
    float* words = reinterpret_cast<float*>(sk_smem);
    std::fill(words, words + sizeof(sk_smem) / 4, std::nanf(""));
    sk_host_block block(threads);
    block.kernel = &kernel;
    sk_host_current = &block;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::fill(words, words + (shared + 3) / 4, std::nanf(""));
                blockIdx = {x, y, z};
                block.finished = 0;
                block.phases = (x + y + z) % 2;
                for (unsigned t = 0; t < threads; ++t) {
                    ucontext_t& c = block.threads[t];
                    getcontext(&c);
                    c.uc_stack.ss_sp = block.stacks[t].get();
                    c.uc_stack.ss_size = sk_host_block::stack_bytes;
                    c.uc_link = &block.scheduler;
                    makecontext(&c, sk_host_thread_main, 0);
                    block.ready.push_back(t);
                }
                while (!block.ready.empty()) {
                    block.running = block.ready.front();
                    block.ready.pop_front();
                    threadIdx = {block.running, 0, 0};
                    swapcontext(&block.scheduler, &block.threads[block.running]);
                }
                if (block.finished != threads) {
                    std::fprintf(stderr, "block (%u, %u, %u): %u of %u threads wait at a "
                                 "barrier the others never reach\n", x, y, z,
                                 threads - block.finished, threads);
                    std::abort();
                }
            }
    sk_host_current = nullptr;
}

// A kernel's pointer parameter from an address.
struct sk_host_ptr {
    void* p;
    template <typename T> operator T*() const { return static_cast<T*>(p); }
};
