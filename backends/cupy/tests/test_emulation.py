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
// Each thread logs 2 t before its warp's barrier and 2 t + 1 after it, plus 128 times the
// phase, in four phases between the block's barriers.
inline int sk_event = 0;
__global__ void sk_ahead(int* log) {
    for (int phase = 0; phase < 4; ++phase) {
        log[sk_event++] = 128 * phase + 2 * threadIdx.x;
        __syncwarp();
        log[sk_event++] = 128 * phase + 2 * threadIdx.x + 1;
        __syncthreads();
    }
}
extern "C" void ahead(int* log) {
    sk_event = 0;
    sk_host_launch({1, 1, 1}, 64, 0, [&] { sk_ahead(log); });
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


def test_a_warp_runs_ahead_to_the_blocks_barrier_in_every_other_phase(host_snippet):
    """A race between warps (one warp's stores over a tile that another still reads before
    the block's barrier) shows only when a warp gets past its own barriers first."""
    library = host_snippet(SNIPPET)
    log = np.full(4 * 128, -1, dtype=np.int32)
    library.ahead(log.ctypes.data_as(ctypes.c_void_p))
    assert sorted(log) == list(range(4 * 128))  # every thread before and after, once a phase
    ran_ahead = []
    for phase in range(4):
        at = {int(e) % 128: i for i, e in enumerate(log) if e // 128 == phase}
        last = [[max(at[64 * w + 2 * t + after] for t in range(32)) for after in (0, 1)]
                for w in (0, 1)]  # [warp][before, after]: its last event in log order
        # one warp done past its barrier before the other's last event before it
        ran_ahead.append(last[0][1] < last[1][0] or last[1][1] < last[0][0])
    assert ran_ahead == [False, True, False, True], log.reshape(4, 128)


def test_a_barrier_a_thread_skips_aborts_with_a_message(host_snippet):
    library = host_snippet(SNIPPET)
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "out = (ctypes.c_int * 64)(); lib.skip(out)")
    done = subprocess.run([sys.executable, "-c", code, library._name], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "block (0, 0, 0): 63 of 64 threads wait at a barrier the others never reach" \
        in done.stderr, done.stderr
