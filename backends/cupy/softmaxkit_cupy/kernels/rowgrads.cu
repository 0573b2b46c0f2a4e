// Row kernels with a gradient: softmax_vjp, log_softmax_vjp and cross-entropy with its fused
// gradient, along the last axis of [rows, n] arrays.  Same layout as rows.cu (G threads own a
// row, K 16-byte loads each, the whole row in registers between its one read and one write);
// rows longer than one block holds are left to other backends.  Edge rules follow
// softmaxkit/reference/rows.py line by line (see the comments at each rule).
#include "rows.cu"

// two arrays in registers (or logits plus mask bits): up to 128 registers per thread
#define SK_GRAD_MIN_BLOCKS(THREADS) ((THREADS) < 512 ? 512 / (THREADS) : 1)

#define SK_SOFTMAX_VJP 3
#define SK_LOG_SOFTMAX_VJP 4

// Load slot j of a row: VEC values into `raw` (out-of-range values are `fill`), and the bits of
// positions that are in range and allowed by the mask.
template <typename T>
__device__ __forceinline__ unsigned sk_load_slot(uint4& raw, const T* row,
                                                 const unsigned char* wrow, int base, int n,
                                                 bool active, bool vec_ok, float fill) {
    constexpr int VEC = 16 / sizeof(T);
    T* v = reinterpret_cast<T*>(&raw);
    unsigned bits = 0;
    if (active && vec_ok && base < n) {
        raw = __ldg(reinterpret_cast<const uint4*>(row + base));
        bits = (1u << VEC) - 1u;
        if (wrow) {
            unsigned char keep[VEC];
            sk_load_keep<VEC>(keep, wrow + base);
#pragma unroll
            for (int e = 0; e < VEC; ++e)
                if (!keep[e]) bits &= ~(1u << e);
        }
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const int i = base + e;
            const bool in = active && i < n;
            v[e] = in ? row[i] : sk_from_float<T>(fill);
            if (in && (!wrow || wrow[i])) bits |= 1u << e;
        }
    }
    return bits;
}

// Sum two values over the G threads of a group (every thread gets the totals).
template <int THREADS, int G>
__device__ __forceinline__ void sk_group_sum2(float& a, float& b, float* scratch) {
    constexpr int WIDTH = G < 32 ? G : 32;
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off /= 2) {
        a += __shfl_xor_sync(0xffffffffu, a, off);
        b += __shfl_xor_sync(0xffffffffu, b, off);
    }
    if (G > 32) {
        constexpr int WARPS = THREADS / 32;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        __syncthreads();  // scratch may still be read by an earlier reduction
        if (lane == 0) {
            scratch[warp] = a;
            scratch[WARPS + warp] = b;
        }
        __syncthreads();
        a = lane < WARPS ? scratch[lane] : 0.0f;
        b = lane < WARPS ? scratch[WARPS + lane] : 0.0f;
#pragma unroll
        for (int off = 16; off > 0; off /= 2) {
            a += __shfl_xor_sync(0xffffffffu, a, off);
            b += __shfl_xor_sync(0xffffffffu, b, off);
        }
    }
}

// softmax_vjp: g = p (c - sum p c), with excluded positions p = c = 0 and c = 0 where p == 0.
// log_softmax_vjp: g = c - exp(lp) sum c over allowed positions (where, and lp != -inf), else 0.
template <typename T, int OP, int THREADS, int G, int K>
__global__ void __launch_bounds__(THREADS, SK_GRAD_MIN_BLOCKS(THREADS)) sk_vjp(
    const T* __restrict__ a, long long ld_a, const T* __restrict__ c, long long ld_c,
    const unsigned char* __restrict__ w, long long ld_w, T* __restrict__ out, long long rows,
    int n, int vec_ok) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr bool PRECISE = sizeof(T) == 4;
    __shared__ float scratch[2 * (THREADS / 32 + 1)];
    const int lane = sk_group_lane<THREADS, G>();
    const long long row = sk_group_row<THREADS, G>();
    const bool active = row < rows;
    const T* ar = a + row * ld_a;
    const T* cr = c + row * ld_c;
    const unsigned char* wr = w ? w + row * ld_w : nullptr;

    uint4 ra[K], rc[K];
    unsigned keep[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const int base = (j * G + lane) * VEC;
        keep[j] = sk_load_slot<T>(ra[j], ar, wr, base, n, active, vec_ok, 0.0f);
        sk_load_slot<T>(rc[j], cr, nullptr, base, n, active, vec_ok, 0.0f);
    }
    typename SkWide<PRECISE>::type acc = 0;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const T* va = reinterpret_cast<const T*>(&ra[j]);
        const T* vc = reinterpret_cast<const T*>(&rc[j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const bool k = (keep[j] >> e) & 1u;
            const float fa = sk_to_float(va[e]);
            const float fc = sk_to_float(vc[e]);
            if (OP == SK_SOFTMAX_VJP) {
                const float p = k ? fa : 0.0f;
                const float cv = (k && p != 0.0f) ? fc : 0.0f;
                acc += static_cast<decltype(acc)>(p * cv);
            } else {
                const bool allowed = k && fa != -SK_INF;
                acc += allowed ? static_cast<decltype(acc)>(fc) : 0;
            }
        }
    }
    float total = static_cast<float>(acc), unused = 0.0f;
    sk_group_sum2<THREADS, G>(total, unused, scratch);
    if (!active) return;
    T* orow = out + row * n;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const int base = (j * G + lane) * VEC;
        const T* va = reinterpret_cast<const T*>(&ra[j]);
        const T* vc = reinterpret_cast<const T*>(&rc[j]);
        T o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const bool k = (keep[j] >> e) & 1u;
            const float fa = sk_to_float(va[e]);
            const float fc = sk_to_float(vc[e]);
            float g;
            if (OP == SK_SOFTMAX_VJP) {
                const float p = k ? fa : 0.0f;
                // a position with p = 0 takes no part: its gradient is 0 even when the
                // row's total is inf or NaN (spec: softmax_vjp)
                g = p != 0.0f ? p * (fc - total) : 0.0f;
            } else {
                const bool allowed = k && fa != -SK_INF;
                g = allowed ? fc - sk_exp<PRECISE>(fa) * total : 0.0f;
            }
            o[e] = sk_from_float<T>(g);
        }
        sk_rows_store<T, VEC>(orow, base, n, vec_ok, o);
    }
}

// Cross-entropy with class-index targets (softmaxkit/reference/rows.py, cross_entropy).  A
// class is included when the mask allows it and its logit is above -inf; with count the
// number of included classes, y = (1 - eps) onehot(t) + eps / count on the included ones,
// loss = -sum_{y > 0} y log p (+inf when target mass sits on an excluded class), and, when
// `grad` is given, grad = scale (p - y) on included classes and 0 elsewhere.  Rows whose
// target is ignore_index give loss 0 and gradient 0; an allowed NaN or +inf gives NaN, and so
// does a target outside [0, n) (the frontend checks the range only where it costs no device
// read, so the kernel must never index the row with it).
template <typename T, int THREADS, int G, int K>
__global__ void __launch_bounds__(THREADS, SK_GRAD_MIN_BLOCKS(THREADS)) sk_xent(
    const T* __restrict__ x, long long ld_x, const unsigned char* __restrict__ w,
    long long ld_w, const long long* __restrict__ index, float* __restrict__ loss,
    T* __restrict__ grad, long long rows, int n, int vec_ok, long long ignore_index,
    int has_ignore, float smoothing, const float* __restrict__ scale_ptr, float scale_value) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr bool PRECISE = sizeof(T) == 4;
    __shared__ float scratch[3 * (THREADS / 32 + 1)];
    const int lane = sk_group_lane<THREADS, G>();
    const long long row = sk_group_row<THREADS, G>();
    const bool active = row < rows;
    const T* xr = x + row * ld_x;
    const unsigned char* wr = w ? w + row * ld_w : nullptr;

    uint4 raw[K];
    unsigned inc[K];  // included classes: allowed by the mask and above -inf
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const int base = (j * G + lane) * VEC;
        inc[j] = sk_load_slot<T>(raw[j], xr, wr, base, n, active, vec_ok, -SK_INF);
        T* v = reinterpret_cast<T*>(&raw[j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            if (!((inc[j] >> e) & 1u)) v[e] = sk_from_float<T>(-SK_INF);
            if (sk_to_float(v[e]) == -SK_INF) inc[j] &= ~(1u << e);
        }
    }
    float m = -SK_INF;
    int nan = 0;
    typename SkWide<PRECISE>::type sum_x = 0;
    float count = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const T* v = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float f = sk_to_float(v[e]);
            nan |= f != f;
            m = fmaxf(m, f);
            if ((inc[j] >> e) & 1u) {
                sum_x += static_cast<decltype(sum_x)>(f);
                count += 1.0f;
            }
        }
    }
    typename SkWide<PRECISE>::type s_acc = 0;
    const bool none = m == -SK_INF;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const T* v = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            s_acc += none ? 0 : static_cast<decltype(s_acc)>(sk_exp<PRECISE>(sk_to_float(v[e]) - m));
    }
    float s = static_cast<float>(s_acc);
    sk_group_reduce<THREADS, G, PRECISE>(m, s, nan, scratch);
    float sx = static_cast<float>(sum_x);
    sk_group_sum2<THREADS, G>(sx, count, scratch);
    if (!active) return;

    const long long t = index[row];
    const bool valid = !(has_ignore && t == ignore_index);
    const bool unknown = valid && (t < 0 || t >= n);
    const bool special = nan != 0 || m == SK_INF || unknown;
    const bool empty = !special && m == -SK_INF;
    const float logs = empty ? 0.0f : sk_log<PRECISE>(s);
    if (lane == 0) {
        float l = 0.0f;
        if (valid) {
            if (special) {
                l = SK_NAN;
            } else {
                const float xt = sk_to_float(xr[t]);
                const bool t_included = (!wr || wr[t]) && xt != -SK_INF;
                const float logp_t = t_included ? (xt - m) - logs : -SK_INF;
                if (smoothing != 1.0f) l -= (1.0f - smoothing) * logp_t;
                if (smoothing != 0.0f && count > 0.0f)
                    l -= smoothing / count * ((sx - count * m) - count * logs);
            }
        }
        loss[row] = l + 0.0f;  // +0.0 for a row without target mass
    }
    if (grad == nullptr) return;
    const float gs = scale_ptr ? *scale_ptr : scale_value;
    const float inv = empty ? 0.0f : 1.0f / s;
    const float uniform = count > 0.0f ? smoothing / count : 0.0f;
    T* grow = grad + row * n;
#pragma unroll
    for (int j = 0; j < K; ++j) {
        const int base = (j * G + lane) * VEC;
        const T* v = reinterpret_cast<const T*>(&raw[j]);
        T o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float g = 0.0f;
            if ((inc[j] >> e) & 1u) {
                const float p = sk_exp<PRECISE>(sk_to_float(v[e]) - m) * inv;
                const float y = uniform + (base + e == t ? 1.0f - smoothing : 0.0f);
                g = (p - y) * gs;
            }
            if (special) g = SK_NAN;
            if (!valid) g = 0.0f;
            o[e] = sk_from_float<T>(g);
        }
        sk_rows_store<T, VEC>(grow, base, n, vec_ok, o);
    }
}
