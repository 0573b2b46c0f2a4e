// The float16 type the kernels' headers name, for a host build (tests/host/emulation.h): the
// value is its IEEE binary16 bits; conversions as CUDA's cuda_fp16.h makes them (to float16
// to nearest, ties to even, subnormals kept, past the largest to inf; NaN to 0x7fff).
#pragma once
#include <cmath>
#include <cstring>

struct __half {
    unsigned short x;
};
struct __half2 {
    __half x, y;  // x in the low half of the 32-bit word
};
// Exact (every float16 is a float32).
inline float __half2float(__half h) {
    const unsigned sign = (h.x & 0x8000u) << 16, exp = (h.x >> 10) & 0x1fu, man = h.x & 0x3ffu;
    float f;
    if (exp == 0) {  // zero or subnormal: man 2^-24
        f = std::ldexp(static_cast<float>(man), -24);
        return sign ? -f : f;
    }
    const unsigned u = sign | (exp == 31 ? 0x7f800000u | man << 13 : (exp + 112) << 23 | man << 13);
    std::memcpy(&f, &u, 4);
    return f;
}
// To nearest, ties to even: a normal result rounds the float32's 23-bit mantissa to 10 bits on
// its bits (carrying into the exponent, up to inf); a subnormal one is |f| 2^24 rounded to an
// integer to nearest even (exact arithmetic: |f| < 2^-14 scales without loss), 1024 being the
// smallest normal.
inline __half __float2half_rn(float f) {
    if (std::isnan(f)) return {0x7fff};
    unsigned u;
    std::memcpy(&u, &f, 4);
    const unsigned sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x477ff000u) return {static_cast<unsigned short>(sign | 0x7c00u)};  // >= 65520
    if (a >= 0x38800000u) {  // >= 2^-14: normal
        unsigned m = a - (112u << 23);
        m += 0xfffu + ((m >> 13) & 1u);
        return {static_cast<unsigned short>(sign | (m >> 13))};
    }
    float mag;
    std::memcpy(&mag, &a, 4);
    const float scaled = std::nearbyint(std::ldexp(mag, 24));  // the default mode: to even
    return {static_cast<unsigned short>(sign | static_cast<unsigned>(scaled))};
}
inline __half2 __floats2half2_rn(float lo, float hi) {
    return {__float2half_rn(lo), __float2half_rn(hi)};
}
