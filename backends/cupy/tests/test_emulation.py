"""The host emulation the kernels' CPU tests run on (tests/host/emulation.h): the orders its
threads take between barriers, and a barrier that some thread skips."""

import ctypes
import subprocess
import sys

import numpy as np

SNIPPET = r"""
// Each thread writes its index at the next position of each of three phases, a barrier
// after each phase and another once thread 0 has reset the position.
inline int sk_position = 0;
__global__ void sk_order(int* seen) {
    for (int phase = 0; phase < 3; ++phase) {
        seen[phase * blockDim.x + sk_position++] = threadIdx.x;
        __syncthreads();
        if (threadIdx.x == 0) sk_position = 0;
        __syncthreads();
    }
}
extern "C" void order(int* seen, unsigned threads) {
    sk_position = 0;
    sk_host_launch({1, 1, 1}, threads, 0, [&] { sk_order(seen); });
}
// Thread 5 leaves early: the others wait at a barrier it never reaches.
__global__ void sk_skip(int* out) {
    if (threadIdx.x == 5) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}
extern "C" void skip(int* out) {
    sk_host_launch({2, 1, 1}, 64, 0, [&] { sk_skip(out); });
}
"""


def test_threads_between_barriers_run_in_more_than_one_order(host_snippet):
    library = host_snippet(SNIPPET)
    threads = 64
    seen = np.full(3 * threads, -1, dtype=np.int32)
    library.order(seen.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint(threads))
    phases = seen.reshape(3, threads)
    for phase in phases:
        assert sorted(phase) == list(range(threads))  # every thread once a phase
    assert list(phases[0]) == list(range(threads))
    # a later phase runs them in another order, most in descending order
    assert any(np.sum(np.diff(p) < 0) >= threads - 3 for p in phases[1:]), phases


def test_a_barrier_a_thread_skips_aborts_with_a_message(host_snippet):
    library = host_snippet(SNIPPET)
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "out = (ctypes.c_int * 64)(); lib.skip(out)")
    done = subprocess.run([sys.executable, "-c", code, library._name], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "block (0, 0, 0): 63 of 64 threads wait at a barrier the others never reach" \
        in done.stderr, done.stderr
