"""softmaxkit on Dask against SciPy's array-API logsumexp and softmax on the same Dask array.

The input is a float32 array of 4 x 2**26 (1 GiB) in a file on disk, chunked along the reduced
axis into 64 chunks, read through a store that counts its reads.  For each method the table
gives the time of one run (the median of ``--repeat`` rounds in which the methods take turns,
after one untimed warm-up round), the
reads of each chunk from the store in one run, and the passes over each chunk: how many tasks
of the graph take the chunk as input (Dask loads a chunk once and keeps it while later tasks
need it, so reads stay at 1 while passes count the work done on the data).

Run with ``python benchmarks/dask_rows.py`` (``--log2-length 22`` for a quick run).  It uses
Dask's local threaded scheduler with one thread per core.
"""

from __future__ import annotations

import os

os.environ["SCIPY_ARRAY_API"] = "1"  # before scipy is imported: scipy.special takes dask arrays

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import dask  # noqa: E402
import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402
import scipy  # noqa: E402
import scipy.special  # noqa: E402
from dask.core import get_dependencies  # noqa: E402

import softmaxkit as sk  # noqa: E402


class CountingStore:
    """A read-only array on disk (``numpy.memmap``) that counts the reads of each chunk."""

    def __init__(self, path: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.data = np.memmap(path, mode="r", shape=shape, dtype=dtype)
        self.shape, self.dtype, self.ndim = self.data.shape, self.data.dtype, self.data.ndim
        self.reads: Counter[int] = Counter()
        self._lock = threading.Lock()

    def __getitem__(self, key: Any) -> np.ndarray:
        start = key[-1].start or 0 if isinstance(key, tuple) else 0
        with self._lock:
            self.reads[start] += 1
        return np.array(self.data[key])


def make_input(path: str, rows: int, length: int, seed: int = 0) -> None:
    """Write normal(0, 3) float32 logits to ``path``, a slice at a time."""
    out = np.memmap(path, mode="w+", shape=(rows, length), dtype=np.float32)
    rng = np.random.default_rng(seed)
    step = 1 << 22
    for i in range(rows):
        for j in range(0, length, step):
            out[i, j:j + step] = rng.standard_normal(min(step, length - j), dtype=np.float32) * 3
    out.flush()
    del out


def passes(result: Any, input_name: str) -> float:
    """Tasks per input chunk that take the chunk as an input, in the graph as built."""
    graph = dict(result.__dask_graph__())
    readers: Counter[Any] = Counter()
    for key in graph:
        for dep in get_dependencies(graph, key):
            if isinstance(dep, tuple) and dep[0] == input_name:
                readers[dep] += 1
    return sum(readers.values()) / max(len(readers), 1)


def run_once(method: Callable[[Any], Any], store: CountingStore, chunk: int,
             reduce: bool, out: np.ndarray) -> tuple[float, float]:
    """(seconds, reads per chunk) of one run of ``method``."""
    x = da.from_array(store, chunks=(store.shape[0], chunk), name="input", asarray=True,
                      lock=False)
    store.reads.clear()
    start = time.perf_counter()
    result = method(x)
    if reduce:
        result.compute()
    else:
        da.store(result, out, lock=False)
    seconds = time.perf_counter() - start
    return seconds, sum(store.reads.values()) / len(x.chunks[-1])


def input_passes(method: Callable[[Any], Any], store: CountingStore, chunk: int) -> float:
    """Tasks per input chunk that take the chunk as an input, in the graph as built."""
    x = da.from_array(store, chunks=(store.shape[0], chunk), name="input", asarray=True,
                      lock=False)
    return passes(method(x), "input")


METHODS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "logsumexp softmaxkit": (lambda x: sk.logsumexp(x, axis=-1), True),
    "logsumexp scipy": (lambda x: scipy.special.logsumexp(x, axis=-1), True),
    "softmax softmaxkit": (lambda x: sk.softmax(x, axis=-1), False),
    "softmax scipy": (lambda x: scipy.special.softmax(x, axis=-1), False),
}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--log2-length", type=int, default=26)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    length = 1 << args.log2_length
    chunk = -(-length // args.chunks)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "logits.f32")
        make_input(path, args.rows, length)
        store = CountingStore(path, (args.rows, length), np.float32)
        print(f"float32 {args.rows} x 2^{args.log2_length} ({store.data.nbytes / 2**30:.2f} GiB), "
              f"{args.chunks} chunks along the reduced axis; dask {dask.__version__} threaded "
              f"scheduler, {args.workers} threads; scipy {scipy.__version__}; "
              f"median of {args.repeat}")
        print()
        print("| operation | method | time (s) | reads / chunk | passes / chunk | speed-up |")
        print("|---|---|---:|---:|---:|---:|")
        out = np.empty(store.shape, dtype=np.float32)
        times: dict[str, list[float]] = {label: [] for label in METHODS}
        reads: dict[str, float] = {}
        with dask.config.set(scheduler="threads", num_workers=args.workers):
            # methods take turns in every round, so a change of load hits them alike;
            # round 0 warms up the page cache and compiles kernels
            for round_ in range(args.repeat + 1):
                for label, (method, reduce) in METHODS.items():
                    seconds, reads[label] = run_once(method, store, chunk, reduce, out)
                    if round_:
                        times[label].append(seconds)
        results = {label: (statistics.median(times[label]), reads[label],
                           input_passes(METHODS[label][0], store, chunk))
                   for label in METHODS}
        for label, (seconds, nreads, npasses) in results.items():
            op, who = label.split()
            speedup = results[f"{op} scipy"][0] / seconds
            print(f"| {op} | {who} | {seconds:.2f} | {nreads:g} | {npasses:g} | "
                  f"{speedup:.2f}x |")
        backends = sk.backend_opts(trace=True)
        with backends as trace, dask.config.set(scheduler="synchronous"):
            small = da.from_array(np.zeros((2, 64), np.float32), chunks=(2, 32))
            sk.softmax(small, axis=-1).compute()
            sk.logsumexp(small, axis=-1).compute()
        chunk_kernels = sorted({(r.op, r.backend) for r in trace if r.backend != "dask"})
        print()
        print("chunk kernels: " + ", ".join(f"{op} on {b}" for op, b in chunk_kernels))


if __name__ == "__main__":
    main()
