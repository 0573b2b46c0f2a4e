// The host meaning of the device functions the kernels write in PTX (tests/conftest.py takes
// their definitions out of the source and includes this instead).
#pragma once

// cp.async of 16 bytes, done at once; 0 source bytes (not valid) zero the destination.
inline void sk_cp_async16(void* smem, const void* gmem, bool valid) {
    if (valid)
        std::memcpy(smem, gmem, 16);
    else
        std::memset(smem, 0, 16);
}
inline void sk_cp_async_commit() {}
template <int N> inline void sk_cp_async_wait() {}

// ex2.approx.ftz.f32: 2^x with results below the normal range flushed to +0.
inline float sk_ex2(float x) {
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}
