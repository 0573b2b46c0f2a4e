// The bfloat16 type the kernels' headers name, for a host build (tests/host/emulation.h):
// declared only, since the float32 kernels tested on the host never convert one.
#pragma once
struct __nv_bfloat16 {
    unsigned short x;
};
float __bfloat162float(__nv_bfloat16);
__nv_bfloat16 __float2bfloat16_rn(float);
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
__nv_bfloat162 __floats2bfloat162_rn(float, float);
