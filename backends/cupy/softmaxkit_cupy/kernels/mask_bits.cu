// Boolean attention masks as the attention kernels read them (exclusion.cuh): bit j % 32 of
// word j / 32 of row (b, h, i) is mask[b, h, i, j], 1 where query i may attend to key j; the
// bits past lk are 0.  A tile's test per score is then a shift of a word it loaded once for
// 32 keys, where reading the byte mask cost a load per score.
//
// mask [B, H, Lq, Lk] by element strides (bytes; 0 along broadcast dims), bits [Bm, Hm, Lqm,
// words] contiguous, where a broadcast dim of the mask has size 1.  One warp per word: lane l
// reads key 32 w + l (32 consecutive bytes where the mask is contiguous along the keys) and
// the warp's ballot is the word.
template <typename M>
__global__ void __launch_bounds__(256) sk_mask_bits(
    const M* __restrict__ mask, unsigned* __restrict__ bits, long long sb, long long sh,
    long long sq, long long sk, int hm, int lqm, int lk, int words, long long total) {
    const int lane = threadIdx.x % 32;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
    // w is the same in every lane of a warp, so the whole warp takes part in each ballot
    for (long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
         w < total; w += warps) {
        const int word = static_cast<int>(w % words);
        const long long row = w / words;
        const long long i = row % lqm, bh = row / lqm;
        const long long h = bh % hm, b = bh / hm;
        const int j = word * 32 + lane;
        const bool on = j < lk && mask[b * sb + h * sh + i * sq + j * sk] != 0;
        const unsigned got = __ballot_sync(0xffffffffu, on);
        if (lane == 0) bits[w] = got;
    }
}
