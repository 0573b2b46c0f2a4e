"""How a row of N words is spread over threads and blocks: the strategy by row length.

A *group* of ``threads`` threads holds one *chunk* of ``threads * slots`` words in registers,
each thread ``slots`` words at positions ``lane + threads * j`` (each load instruction of a
warp reads consecutive addresses).  A word is 16 bytes of a row (4 float32, 8 bfloat16) or,
when the row cannot be read in 16-byte words, one element.

* short rows (up to ``32 * slots`` words): a group of up to 32 threads per row (a warp or a
  part of one), several rows per block, reductions by shuffles;
* medium rows (up to ``block * slots`` words, ``block`` = 256 or 128 threads): a block per
  row;
* long rows: the row is split into ``chunks`` chunks of ``block * slots`` words, one block
  (of whole warps) each; every block reads its chunk once, keeps it on chip, and the blocks
  of a row combine their (max, sum) summaries (see :mod:`.row_kernels`).

Rows that the register plan splits, read in 16-byte words, are staged in shared memory
instead (:func:`staged`, :mod:`.staged`): one chunk when the row fits in a stage of
:data:`STAGE_BYTES`, else the fewest equal chunks that fit.  The chunks of a row of 2 to
:data:`MAX_CLUSTER` chunks are launched as one thread-block cluster (:func:`clustered`);
rows of more chunks, up to 16 chunks of 128 KB, take a persistent grid of clusters that each
walk several rows (:func:`persistent`).

Kernels that walk a row in tiles instead (:mod:`.tiled`) read ``chunks`` as the number of
tiles.  This module imports no numba and reads no settings: the plan is plain arithmetic on
its arguments, tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

WARP = 32
GROUP_THREADS = 256
"""Threads of a block made of several short-row groups."""
BLOCK = 256
"""Threads of a block holding one chunk of a long row."""
MAX_THREADS = 1024
WORD_BYTES = 16
STAGE_BYTES = 64 * 1024
"""Shared memory of a block staging a row or a chunk of one: three blocks fit on a
multiprocessor of 228 KB."""
STAGE_THREADS = 256
MAX_CLUSTER = 8
"""Chunks of a row launched as one cluster at most (the portable cluster size; 16-block
clusters, which need the non-portable opt-in, measured slower than the exchange through
device memory at 256 x 524288 bfloat16)."""
LARGEST_CLUSTER = 16

def _pow2_at_least(v: int) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


@dataclass(frozen=True)
class Plan:
    """Threads per group, words per thread, rows per block, chunks per row."""

    threads: int
    slots: int
    rows_per_block: int
    chunks: int

    @property
    def block(self) -> int:
        """Threads per block."""
        return self.threads * self.rows_per_block

    @property
    def chunk_words(self) -> int:
        """Words of a row held by one group."""
        return self.threads * self.slots

    def grid(self, n_rows: int) -> int:
        """Blocks to launch for ``n_rows`` rows: one per group of rows, or per chunk."""
        if self.chunks > 1:
            return max(1, n_rows * self.chunks)
        return self.grid_rows(n_rows)

    def grid_rows(self, n_rows: int) -> int:
        """Blocks to launch for ``n_rows`` rows when a group walks its row's chunks as tiles."""
        return max(1, -(-n_rows // self.rows_per_block))

    @property
    def split(self) -> bool:
        """Whether a row spans several chunks."""
        return self.chunks > 1


def make(threads: int, slots: int, n: int, group_threads: int = GROUP_THREADS) -> Plan:
    """The plan with ``threads`` threads of ``slots`` words each for rows of ``n`` words.

    Groups of 32 threads or fewer share a block of ``group_threads`` threads (several rows per
    block); larger groups are a block each.
    """
    if threads & (threads - 1) or not 0 < threads <= MAX_THREADS or not 0 < slots <= 64:
        raise ValueError(f"invalid plan: threads={threads}, slots={slots}")
    chunks = max(1, -(-n // (threads * slots)))
    if chunks > 1 and threads < WARP:
        raise ValueError(f"a row split across blocks needs blocks of whole warps "
                         f"(threads={threads})")
    rows = max(1, group_threads // threads) if threads <= WARP and chunks == 1 else 1
    return Plan(threads, slots, rows, chunks)


def choose(n: int, slots: int | tuple[int, int, int], simulator: bool = False,
           block: int = BLOCK, forced: tuple[int, int] | None = None) -> Plan:
    """The plan for rows of ``n`` words (see the module docstring).

    ``slots`` is the words a thread holds (the caller's register budget), or a triple for
    short, medium and long rows; ``block`` the threads of a block that holds a medium row or
    a chunk of a long one.  ``forced`` ``(threads, slots)`` replaces the choice.
    """
    short, medium, long = (slots,) * 3 if isinstance(slots, int) else slots
    if forced:
        threads, k = forced
        if n <= threads * k or threads >= WARP:
            return make(threads, k, n)
        return make(WARP, k, n)  # a short-row group too small for this row
    if simulator:  # few threads keep the simulator fast; long rows are still split
        if n <= 16:
            return make(_pow2_at_least(max(1, -(-n // 2))), 2, n, group_threads=16)
        return make(WARP, 4, n, group_threads=WARP)
    if n <= WARP * short:
        return make(_pow2_at_least(max(1, -(-n // short))), short, n)
    if n <= block * medium:
        return make(max(2 * WARP, _pow2_at_least(-(-n // medium))), medium, n)
    return make(block, long, n)


def staged(n: int, simulator: bool = False, stage_bytes: int = STAGE_BYTES,
           threads: int = STAGE_THREADS, forced: tuple[int, int] | None = None) -> Plan:
    """The plan for rows of ``n`` 16-byte words staged in shared memory: one block per row
    when the row fits in ``stage_bytes``, else the fewest equal chunks that fit; ``threads``
    threads a block (one chunk at a time).

    ``forced`` ``(threads, slots)`` replaces the choice when it names whole warps.
    """
    if forced and forced[0] >= WARP:
        return make(forced[0], forced[1], n, group_threads=forced[0])
    if simulator:  # one warp; rows of up to 256 words are one chunk, longer ones split
        return make(WARP, min(8, -(-n // WARP)), n, group_threads=WARP)
    chunks = max(1, -(-n * WORD_BYTES // stage_bytes))
    words = -(-n // chunks)
    return make(threads, -(-words // threads), n, group_threads=threads)


def clustered(n: int, simulator: bool = False, mode: str = "",
              forced: tuple[int, int] | None = None) -> Plan | None:
    """The plan for staged rows of ``n`` 16-byte words whose chunks form one thread-block
    cluster (a block each, ``chunks`` blocks a cluster), or ``None`` when such rows take
    :func:`staged` with the exchange through device memory instead.

    The chunks are those of :func:`staged` (64 KB; 32 KB and 128 KB chunks measured slower
    in clusters); a row of 2 to :data:`MAX_CLUSTER` of them is clustered.  ``mode`` (the
    setting ``cluster``) ``"0"`` turns clusters off, a number sets the largest cluster, and
    ``"all"`` clusters rows of one chunk too.  The simulator runs the blocks of a grid one
    after another, so there only a cluster of one block is possible: rows of one chunk with
    ``"all"``.  ``forced`` as in :func:`staged`.
    """
    if mode == "0":
        return None
    largest = (LARGEST_CLUSTER if mode == "all"
               else min(LARGEST_CLUSTER, int(mode)) if mode.isdigit() else MAX_CLUSTER)
    p = staged(n, simulator, forced=forced)
    if p.chunks > largest or (p.chunks == 1 and mode != "all"):
        return None
    if simulator and p.chunks > 1:
        return None
    return p


def persistent(n: int, simulator: bool = False, threads: int = STAGE_THREADS, mode: str = "",
               cluster: str = "", forced: tuple[int, int] | None = None) -> Plan | None:
    """The plan for staged rows of ``n`` 16-byte words served by the persistent grid of
    clusters (:func:`.persistent.persistent`, a block per chunk, :func:`row_clusters` clusters a
    row), or ``None`` when such rows take :func:`clustered` or :func:`staged` instead.

    Rows of :data:`MAX_CLUSTER` + 1 to :data:`LARGEST_CLUSTER` chunks of :func:`staged` (64
    KB) are one cluster; longer rows take :func:`row_clusters` clusters, which exchange their
    parts' summaries through device memory.  ``mode`` (the setting ``persist``) ``"0"`` (or
    ``cluster`` ``"0"``) turns it off, ``"all"`` also gives it shorter rows, ``"wide"`` takes
    chunks of up to 128 KB (a block per multiprocessor) instead of several clusters.  The
    simulator runs clusters of one block: with ``"all"``, rows of one chunk, or of several as
    a cluster each.  Blocks have ``threads`` threads; a ``forced`` chunk is kept as it is.
    """
    if mode == "0" or cluster == "0" or (simulator and mode != "all"):
        return None
    p = staged(n, simulator, threads=threads, forced=forced)
    largest = 1 if simulator else LARGEST_CLUSTER
    if not simulator and p.chunks <= MAX_CLUSTER and mode != "all":
        return None
    if p.chunks <= largest or (mode != "wide" and row_clusters(p, simulator) > 1):
        return p
    if not simulator and not (forced and forced[0] >= WARP):
        p = staged(n, simulator, 2 * STAGE_BYTES, threads)
        if p.chunks <= largest:
            return p
    return None


def held(p: Plan, n: int, held: int, simulator: bool = False) -> Plan | None:
    """The :func:`persistent` plan ``p`` for rows of ``n`` words with ``held`` words of each
    thread kept in registers: chunks of ``2 p.slots`` words a thread (``2 p.slots - held``
    staged, the ``slots`` of the plan returned), so half as many, one cluster a row; ``None``
    where the rows are not whole such chunks or take more than :data:`LARGEST_CLUSTER` of them
    (one in the simulator)."""
    total = 2 * p.slots
    chunk = p.threads * total
    if not 0 < held < total or n % chunk or n // chunk > (1 if simulator else LARGEST_CLUSTER):
        return None
    return Plan(p.threads, total - held, 1, n // chunk)


def row_clusters(p: Plan, simulator: bool = False) -> int:
    """Clusters a row of a :func:`persistent` plan takes, each an equal part of its chunks: 1
    for rows of at most :data:`LARGEST_CLUSTER` chunks (of one in the simulator) and 2 for
    rows of up to twice as many (an even number); 0 for a row that fits none."""
    largest = 1 if simulator else LARGEST_CLUSTER
    if p.chunks <= largest:
        return 1
    return 2 if p.chunks <= 2 * largest and p.chunks % 2 == 0 else 0
