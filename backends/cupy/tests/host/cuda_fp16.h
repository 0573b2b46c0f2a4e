// The 16-bit type the kernels' headers name, for a host build (tests/host/emulation.h):
// declared only, since the float32 kernels tested on the host never convert one.
#pragma once
struct __half {
    unsigned short x;
};
float __half2float(__half);
__half __float2half_rn(float);
struct __half2 {
    __half x, y;
};
__half2 __floats2half2_rn(float, float);
