// The bfloat16 type the kernels' headers name, for a host build (tests/host/emulation.h): the
// value is its 16 bits, the top half of a float32's; conversions as CUDA's cuda_bf16.h makes
// them (to bfloat16 to nearest, ties to even; NaN to the canonical 0x7fff).
#pragma once
#include <cmath>
#include <cstring>

struct __nv_bfloat16 {
    unsigned short x;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;  // x in the low half of the 32-bit word
};
// Exact: the 16 bits are the float32's top half.
inline float __bfloat162float(__nv_bfloat16 h) {
    const unsigned u = static_cast<unsigned>(h.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// To nearest, ties to even, subnormals included; past the largest bfloat16 to inf.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    if (std::isnan(f)) return {0x7fff};
    unsigned u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);  // carries into the exponent (inf past the largest)
    return {static_cast<unsigned short>(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
