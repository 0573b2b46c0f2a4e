// The host meaning of the device functions the kernels write in PTX (tests/conftest.py takes
// their definitions out of the source and includes this instead).
#pragma once
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
inline thread_local std::vector<sk_host_copy> sk_host_open;         // not yet committed
inline thread_local std::deque<std::vector<sk_host_copy>> sk_host_groups;  // committed

inline void sk_cp_async16(void* smem, const void* gmem, bool valid) {
    const float nan = std::nanf("");
    for (int i = 0; i < 4; ++i) std::memcpy(static_cast<char*>(smem) + 4 * i, &nan, 4);
    sk_host_open.push_back({smem, gmem, valid});
}
inline void sk_cp_async_commit() {
    sk_host_groups.push_back(std::move(sk_host_open));
    sk_host_open.clear();
}
template <int N> inline void sk_cp_async_wait() {
    while (sk_host_groups.size() > static_cast<std::size_t>(N)) {
        for (const sk_host_copy& c : sk_host_groups.front()) {
            if (c.valid)
                std::memcpy(c.smem, c.gmem, 16);
            else
                std::memset(c.smem, 0, 16);
        }
        sk_host_groups.pop_front();
    }
}

// ex2.approx.ftz.f32: 2^x with results below the normal range flushed to +0.
inline float sk_ex2(float x) {
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

inline void sk_host_end_thread() {
    sk_host_open.clear();
    sk_host_groups.clear();
}
