"""Kernel configurations: which template instantiations exist and which one serves a shape.

Pure Python (imports no CuPy), so the manifest, the CI compile test and the adapters share one
list: every name expression compiled on the device is one the CI test compiles with nvcc.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

CTYPES = {"float16": "__half", "bfloat16": "sk_bf16", "float32": "float"}
"""softmaxkit dtype name -> the C++ type the kernels use."""

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}

ROW_DTYPE_PAIRS: tuple[tuple[str, str], ...] = (
    ("float16", "float16"),
    ("bfloat16", "bfloat16"),
    ("float32", "float32"),
)
"""(input, output) dtype pairs the row kernels are built for; others are declined (each pair
costs a module of instantiations to build, and other output dtypes are rare)."""

ROW_OPS = {"softmax": 0, "log_softmax": 1, "logsumexp": 2}
"""Row operations served by kernels/rows.cu, with the kernel's OP template argument."""


@dataclass(frozen=True)
class RowConfig:
    """One row-kernel shape: ``group`` threads per row segment, ``k`` 16-byte loads each.

    ``group < threads`` packs several rows per block, ``group == threads`` is one block per
    row, ``cluster > 1`` splits a row over a thread-block cluster.  ``lean`` configurations
    are the 16-bit softmax / log_softmax kernels of kernels/rows16.cuh: in registers, or
    (``staged``) with the segment in shared memory, loaded in ``groups`` cp.async groups;
    ``mode`` holds their mode bits (1: streaming stores; 8: persistent softmax caches its
    exponentials in the staged row, see kernels/rows16.cuh); ``persistent`` staged kernels
    run a grid of the clusters that fit at once, each walking rows and copying its next row
    while it writes the current one; ``policy`` is the cluster scheduling policy set on the
    kernel (0 the driver's default, 1 spread, 2 load balancing).
    """

    threads: int
    group: int
    k: int
    cluster: int = 1
    staged: bool = False
    lean: bool = False
    groups: int = 1
    mode: int = 0
    persistent: bool = False
    policy: int = 0

    def capacity(self, itemsize: int) -> int:
        """The longest row this configuration holds, in elements."""
        return self.group * self.k * (16 // itemsize) * self.cluster

    def shared_bytes(self) -> int:
        """Dynamic shared memory per block (the staged segment)."""
        return self.threads * self.k * 16 if self.staged else 0

    def name(self, op: str, din: str, dout: str) -> str:
        """The C++ name expression of this instantiation."""
        if self.lean:
            if not row_lean(op, din, dout):
                raise ValueError(f"no 16-bit row kernel for {op} {din} -> {dout}")
            head = f"{CTYPES[din]}, {ROW_OPS[op]}, {self.threads}"
            if self.staged:
                kind = "persist" if self.persistent else "staged"
                return (f"sk_rows16_{kind}<{head}, {self.k}, {self.cluster}, {self.groups}, "
                        f"{self.mode}>")
            return f"sk_rows16<{head}, {self.group}, {self.k}, {self.mode}>"
        head = f"{CTYPES[din]}, {CTYPES[dout]}, {ROW_OPS[op]}, {self.threads}"
        if self.cluster == 1:
            return f"sk_rows<{head}, {self.group}, {self.k}>"
        return f"sk_rows_cluster<{head}, {self.k}, {self.cluster}>"

    def describe(self) -> str:
        """A short label: threads, group x loads, cluster, staging."""
        text = f"{self.threads}x{self.k}" if self.group == self.threads else (
            f"{self.threads} threads, {self.group}x{self.k} per row")
        if self.cluster > 1:
            text += f" cluster {self.cluster}"
        if self.staged:
            text += f" staged ({self.groups} groups)"
        if self.persistent:
            text += " persistent"
        if self.policy:
            text += " spread" if self.policy == 1 else " load-balancing"
        if self.mode & 1:
            text += " st.cs"
        if self.mode & 8:
            text += " ex-cache"
        return text


ROW_CONFIGS: tuple[RowConfig, ...] = (
    RowConfig(256, 4, 1),
    RowConfig(256, 4, 2),
    RowConfig(256, 4, 4),
    RowConfig(256, 8, 4),
    RowConfig(256, 16, 4),
    RowConfig(256, 32, 4),
    RowConfig(128, 128, 2),
    RowConfig(128, 128, 4),
    RowConfig(256, 256, 4),
    RowConfig(256, 256, 4, 2),
    RowConfig(256, 256, 4, 4),
    RowConfig(256, 256, 4, 8),
    RowConfig(1024, 1024, 4, 4),
    RowConfig(1024, 1024, 4, 8),
    RowConfig(512, 512, 16, 8),
)
"""The general row kernels (float32, logsumexp), ordered by capacity: the first that holds a
row serves it."""

ROW16_CONFIGS: tuple[RowConfig, ...] = (
    RowConfig(256, 4, 1, lean=True, mode=1),
    RowConfig(256, 8, 1, lean=True, mode=1),
    RowConfig(256, 16, 1, lean=True, mode=1),
    RowConfig(256, 32, 1, lean=True, mode=1),
    RowConfig(256, 32, 2, lean=True, mode=1),
    RowConfig(256, 32, 4, lean=True, mode=1),
    RowConfig(128, 128, 2, lean=True, mode=1),
    RowConfig(256, 256, 2, lean=True, mode=1),
    RowConfig(256, 256, 4, lean=True, mode=1),
    RowConfig(256, 256, 8, staged=True, lean=True, groups=4),
    RowConfig(256, 256, 8, 2, staged=True, lean=True, groups=4),
    RowConfig(256, 256, 8, 4, staged=True, lean=True, groups=4),
    RowConfig(256, 256, 8, 8, staged=True, lean=True, groups=4),
    RowConfig(256, 256, 16, 8, staged=True, lean=True, groups=4),
    RowConfig(256, 256, 16, 16, staged=True, lean=True, groups=4, mode=8, persistent=True,
              policy=2),
)
"""The lean 16-bit softmax / log_softmax kernels (:func:`row_lean`), ordered by capacity,
chosen on the H200 with ``tools/sweep_rows16.py`` (docs/benchmarks-cupy.md): 16 threads of
one load per 128-element row; 256 threads of 2 loads per 4096-element row with streaming
stores; longer rows staged in shared memory in 32 KB blocks, in 2-block clusters up to 32768
elements; at 256 x 524288, 64 KB blocks over 16-block clusters as a persistent grid of the
clusters that fit at once, under the load-balancing cluster policy, softmax caching its
exponentials in the stage."""

ROW_ALTERNATIVES: tuple[RowConfig, ...] = (
    RowConfig(128, 4, 4),
    RowConfig(256, 8, 2),
    RowConfig(1024, 1024, 8, 8),
    RowConfig(128, 128, 4, lean=True, mode=1),
    RowConfig(64, 64, 8, lean=True, mode=1),
    RowConfig(128, 8, 2, lean=True, mode=1),
    RowConfig(256, 8, 2, lean=True, mode=1),
    RowConfig(512, 512, 8, staged=True, lean=True, groups=4),
    RowConfig(512, 512, 8, 16, staged=True, lean=True, groups=4),
    RowConfig(256, 256, 16, 16, staged=True, lean=True, groups=4),
)
"""Other row configurations, built on request only (gpu_check.py compares them)."""

NON_PORTABLE_CLUSTER = 8
"""Clusters larger than this need the non-portable cluster-size attribute at launch."""


def row_lean(op: str, din: str, dout: str) -> bool:
    """Whether the lean 16-bit kernels serve ``op`` from ``din`` to ``dout`` (softmax and
    log_softmax from a 16-bit type to itself)."""
    return op in ("softmax", "log_softmax") and din == dout and ITEMSIZE[din] == 2


CLUSTERLESS_CONFIGS: tuple[RowConfig, ...] = (
    RowConfig(1024, 1024, 4),
    RowConfig(1024, 1024, 8),
)
"""The long rows of the general kernels on devices without thread-block clusters (compute
capability below 9.0): one block of 1024 threads per row, up to 32768 float32 elements."""

CLUSTERLESS_LEAN_CONFIGS: tuple[RowConfig, ...] = (
    RowConfig(1024, 1024, 4, staged=True, lean=True, groups=4),
)
"""The same for the lean 16-bit kernels: one staged block of 1024 threads per row (64 KB of
shared memory, which every device from compute capability 8.0 offers), up to 32768
elements."""

CLUSTER_CAPABILITY = 90
"""The lowest compute capability (as a number, 90 for 9.0) with thread-block clusters."""


def row_configs(lean: bool, clusters: bool = True) -> tuple[RowConfig, ...]:
    """The configurations a call may use, in order of capacity: :data:`ROW16_CONFIGS` for the
    calls :func:`row_lean` admits, :data:`ROW_CONFIGS` otherwise; on a device without
    thread-block clusters (``clusters=False``) those of one block per row, then
    :data:`CLUSTERLESS_LEAN_CONFIGS` or :data:`CLUSTERLESS_CONFIGS`."""
    configs = ROW16_CONFIGS if lean else ROW_CONFIGS
    if clusters:
        return configs
    longer = CLUSTERLESS_LEAN_CONFIGS if lean else CLUSTERLESS_CONFIGS
    return (*(c for c in configs if c.cluster == 1), *longer)


def _holding(configs: tuple[RowConfig, ...], n: int, itemsize: int) -> RowConfig | None:
    """The first of ``configs`` (ordered by capacity) that holds a row of ``n`` elements."""
    return next((c for c in configs if n <= c.capacity(itemsize)), None)


def row_config(n: int, itemsize: int, lean: bool = False,
               clusters: bool = True) -> RowConfig | None:
    """The smallest configuration that holds a row of ``n`` elements, or None if none does."""
    return _holding(row_configs(lean, clusters), n, itemsize)


def max_row_length(itemsize: int, lean: bool = False, clusters: bool = True) -> int:
    """The longest row the row kernels hold on chip (with clusters the lean list holds as long
    a row as the general one)."""
    return row_configs(lean, clusters)[-1].capacity(itemsize)


def row_modules() -> list[tuple[str, str, str, list[str]]]:
    """Every row module the backend may build: ``(op, din, dout, name_expressions)``, the
    configurations with and without clusters (one module serves every device)."""
    modules = []
    for op in ROW_OPS:
        for din, dout in ROW_DTYPE_PAIRS:
            lean = row_lean(op, din, dout)
            configs = dict.fromkeys((*row_configs(lean), *row_configs(lean, clusters=False)))
            modules.append((op, din, dout, [c.name(op, din, dout) for c in configs]))
    return modules


def row_alternative_names(op: str, din: str, dout: str) -> tuple[str, ...]:
    """The name expressions of the module that serves configurations given explicitly (every
    declared and alternative configuration that applies to ``op`` from ``din`` to ``dout``)."""
    lean = row_lean(op, din, dout)
    found = dict.fromkeys(c.name(op, din, dout)
                          for c in (*ROW_CONFIGS, *ROW16_CONFIGS, *CLUSTERLESS_CONFIGS,
                                    *CLUSTERLESS_LEAN_CONFIGS, *ROW_ALTERNATIVES)
                          if lean or not c.lean)
    return tuple(found)


ATTENTION_DTYPES = ("float16", "bfloat16")
ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)
"""Head dimensions the attention kernels are built for, each with D = Dv: multiples of 16
whose rows of 16-byte chunks the shared-memory swizzle of kernels/mma.cuh permutes without
bank conflicts.  Calls at other D and Dv up to the largest (D != Dv included) run at the next
of them on zero-padded copies of their arrays (head_dims.py)."""


@dataclass(frozen=True)
class AttentionConfig:
    """One forward tile shape: ``warps`` warps of ``16 * m_tiles`` query rows, ``block_n`` keys
    per tile; ``mask=False`` builds it without boolean-mask support (fewer registers)."""

    head_dim: int
    warps: int = 4
    block_n: int = 64
    m_tiles: int = 2
    mask: bool = True

    @property
    def block_m(self) -> int:
        """Query rows per block (each warp owns ``m_tiles`` tiles of 16 rows)."""
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: the Q tile and two stages of K and V tiles (16-bit)."""
        return (self.block_m + 4 * self.block_n) * self.head_dim * 2

    def name(self, dtype: str) -> str:
        """The C++ name expression of the forward kernel for ``dtype``."""
        return (f"sk_attn_fwd<{CTYPES[dtype]}, {self.head_dim}, {self.warps}, {self.block_n}, "
                f"{self.m_tiles}, {'true' if self.mask else 'false'}>")

    def varlen_name(self, dtype: str) -> str:
        """The C++ name expression of the packed variable-length forward for ``dtype`` (the
        same tiles, never a boolean mask)."""
        return (f"sk_attn_fwd_varlen<{CTYPES[dtype]}, {self.head_dim}, {self.warps}, "
                f"{self.block_n}, {self.m_tiles}>")


ATTENTION_CONFIGS = {
    32: AttentionConfig(32, warps=4, block_n=128, m_tiles=2),
    64: AttentionConfig(64, warps=4, block_n=64, m_tiles=2),
    80: AttentionConfig(80, warps=4, block_n=64, m_tiles=2),
    96: AttentionConfig(96, warps=4, block_n=32, m_tiles=2),
    128: AttentionConfig(128, warps=4, block_n=32, m_tiles=2),
    160: AttentionConfig(160, warps=8, block_n=64, m_tiles=1),
    192: AttentionConfig(192, warps=8, block_n=64, m_tiles=1),
    256: AttentionConfig(256, warps=8, block_n=32, m_tiles=1),
}
"""The forward configuration for each head dimension, with boolean-mask support.  Above 128
each warp owns one tile of 16 query rows (its output accumulator, D / 2 floats a thread, leaves
no room for a second).  Masked calls at 96 and 256 take 32-key tiles (see
:data:`UNMASKED_CONFIGS`).  At 32 the 128-key tiles, as FlashAttention's, ran 1.15x faster
than 64-key ones on the H200 (docs/benchmarks-attention.md)."""

UNMASKED_CONFIGS = {
    32: AttentionConfig(32, warps=4, block_n=128, m_tiles=2, mask=False),
    96: AttentionConfig(96, warps=4, block_n=64, m_tiles=2, mask=False),
    128: AttentionConfig(128, warps=4, block_n=64, m_tiles=2, mask=False),
    256: AttentionConfig(256, warps=8, block_n=64, m_tiles=1, mask=False),
}
"""Forward configurations for calls without a boolean mask, where they differ: at head
dimension 128 the mask's code would spill registers with 64-key tiles, so masked calls keep
32-key tiles and unmasked ones take the faster 64-key tiles (docs/benchmarks-cupy.md); the
same holds at 96 and 256 (ptxas reports spills for their masked 64-key tiles).  At 32 the
build without the mask's code is a little faster on the same tiles."""

ATTENTION_ALTERNATIVES = (
    *(AttentionConfig(d, warps=8, block_n=64, m_tiles=1) for d in (32, 64, 128)),
    AttentionConfig(128, warps=4, block_n=32, m_tiles=2),
    AttentionConfig(64, warps=4, block_n=64, m_tiles=2, mask=False),
    AttentionConfig(32, warps=4, block_n=64, m_tiles=2),
    AttentionConfig(32, warps=8, block_n=128, m_tiles=1),
    AttentionConfig(32, warps=4, block_n=64, m_tiles=2, mask=False),
)
"""Other forward configurations (gpu_check.py compares them); those not declared above are
built on request only."""


def alternative_names() -> tuple[str, ...]:
    """Name expressions of the alternative forward configurations not declared (a module of
    their own)."""
    declared = set(attention_names())
    return tuple(n for c in ATTENTION_ALTERNATIVES for t in ATTENTION_DTYPES
                 if (n := c.name(t)) not in declared)


FITTING_CONFIGS = {
    160: AttentionConfig(160, warps=4, block_n=32, m_tiles=1),
    192: AttentionConfig(192, warps=8, block_n=32, m_tiles=1),
    256: AttentionConfig(256, warps=4, block_n=32, m_tiles=1),
}
"""Forward tiles for devices whose blocks may take less shared memory than
:data:`ATTENTION_CONFIGS`' need (99 KB on compute capability 8.6, 8.9 and 12.0): 32-key
tiles (and 64 query rows at 160 and 256), with boolean-mask support, 60 to 96 KB.  At 160
eight warps would not copy a 32-key tile in whole steps of the block's threads."""


class _Tiles(Protocol):
    def shared_bytes(self) -> int: ...


_T = TypeVar("_T", bound=_Tiles)


def fitting(preferred: _T, smaller: _T | None, shared_limit: int | None) -> _T:
    """``preferred`` where its shared memory fits ``shared_limit`` bytes (None: no limit) or
    no ``smaller`` configuration is built, else ``smaller`` (which the manifest declines in
    turn if it does not fit either)."""
    if shared_limit is None or smaller is None or preferred.shared_bytes() <= shared_limit:
        return preferred
    return smaller


def attention_config(head_dim: int, masked: bool = True,
                     shared_limit: int | None = None) -> AttentionConfig:
    """The forward configuration for ``head_dim`` (a key of :data:`ATTENTION_CONFIGS`), for a
    call with a boolean mask or (``masked=False``) without one, on a device whose blocks may
    take ``shared_limit`` bytes of shared memory (None: no limit): the unmasked tiles where
    they fit, else the masked ones (smaller: 128 KB against 192 KB at 256, which a device of
    compute capability 8.0 cannot give), else :data:`FITTING_CONFIGS`'."""
    found = fitting(ATTENTION_CONFIGS[head_dim], FITTING_CONFIGS.get(head_dim), shared_limit)
    if masked or head_dim not in UNMASKED_CONFIGS:
        return found
    return fitting(UNMASKED_CONFIGS[head_dim], found, shared_limit)


SM90_SOURCES = frozenset({"attention_sm90.cu", "attention_bwd_sm90.cu"})
"""Kernel sources that use sm_90a instructions (wgmma): built for that target alone and run on
devices of compute capability 9.0 only (arch-specific code runs on no other)."""

SM90_CAPABILITY = 90
"""The compute capability (as a number, 90 for 9.0) of the devices the sm_90a kernels run on."""


@dataclass(frozen=True)
class Sm90Config:
    """One Hopper forward tile shape (kernels/attention_sm90.cu): ``warpgroups`` warpgroups of
    64 query rows each, ``block_n`` keys per tile; ``mask=False`` builds it without the boolean
    mask's code."""

    head_dim: int
    block_n: int = 128
    warpgroups: int = 2
    mask: bool = False

    @property
    def block_m(self) -> int:
        """Query rows per block (64 per warpgroup)."""
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 128 * self.warpgroups

    def shared_bytes(self) -> int:
        """Dynamic shared memory: the Q tile, two stages of K and V tiles (16-bit), and 1 KB
        the kernel aligns the tiles to 1024 bytes with (the 128-byte swizzle needs it)."""
        return (self.block_m + 4 * self.block_n) * self.head_dim * 2 + 1024

    def name(self, dtype: str) -> str:
        """The C++ name expression of the forward kernel for ``dtype``."""
        return (f"sk_attn_fwd_sm90<{CTYPES[dtype]}, {self.head_dim}, {self.block_n}, "
                f"{self.warpgroups}, {'true' if self.mask else 'false'}>")

    def varlen_name(self, dtype: str) -> str:
        """The C++ name expression of the packed variable-length forward for ``dtype`` (the
        same tiles, never a boolean mask)."""
        return (f"sk_attn_fwd_sm90_varlen<{CTYPES[dtype]}, {self.head_dim}, {self.block_n}, "
                f"{self.warpgroups}>")


SM90_CONFIGS = {
    32: Sm90Config(32, block_n=128),
    64: Sm90Config(64, block_n=128),
    96: Sm90Config(96, block_n=128),
    128: Sm90Config(128, block_n=128),
    192: Sm90Config(192, block_n=64),
    256: Sm90Config(256, block_n=64),
}
"""The Hopper forward for each head dimension it is built for, without a boolean mask: two
warpgroups (128 query rows), 128-key tiles (64 at 192 and 256, where the output accumulator
takes more registers and 128-key tiles more than a block's 227 KB of shared memory).  128-key
tiles beat 64-key ones at 128 on the H200 (docs/benchmarks-cupy.md); at 32 and 96 (panels of
32 columns) the tiles beat the mma.sync kernel (1.09-1.11x at 32) and 96 zero-padded to 128
(1.32-1.52x), at 192 the call zero-padded to 256 (1.48-1.73x; bfloat16 B4 H32 L4096 on an
H100, tools/forward_tiles.py, docs/benchmarks-attention.md)."""

SM90_MASKED_CONFIGS = {
    d: replace(SM90_CONFIGS[d], mask=True) for d in (32, 64, 96, 128)
}
"""The Hopper forward for calls with a boolean mask; at 256 the mask's code spills registers,
so masked calls there keep the mma.sync kernel; at 192 its build spills nothing (ptxas, CUDA
13.0) but has not run on a device, and masked calls keep the mma.sync kernel."""

SM90_ALTERNATIVES: tuple[Sm90Config, ...] = ()
"""Other Hopper forward tiles, built on request only (tools/forward_tiles.py times them)."""


def sm90_config(head_dim: int, masked: bool) -> Sm90Config | None:
    """The Hopper forward configuration for ``head_dim``, for a call with a boolean mask or
    without one, or None where none is built."""
    return (SM90_MASKED_CONFIGS if masked else SM90_CONFIGS).get(head_dim)


def sm90_names() -> tuple[str, ...]:
    """The name expressions of the dense kernels of kernels/attention_sm90.cu (one module)."""
    declared = (*SM90_CONFIGS.values(), *SM90_MASKED_CONFIGS.values())
    return tuple(c.name(t) for c in declared for t in ATTENTION_DTYPES)


def sm90_varlen_names() -> tuple[str, ...]:
    """The name expressions of the packed variable-length Hopper forward, on the dense
    tiles of :data:`SM90_CONFIGS` (a module of kernels/attention_sm90.cu of their own)."""
    return tuple(c.varlen_name(t) for c in SM90_CONFIGS.values() for t in ATTENTION_DTYPES)


@dataclass(frozen=True)
class Sm90BackwardConfig:
    """The Hopper backward's tile shape (kernels/attention_bwd_sm90.cu): ``warpgroups``
    warpgroups of 64 keys each (above head dimension 128: one tile of 64 keys, its columns
    split between the warpgroups), query tiles of 64 rows; ``mask=False`` builds it without
    the boolean mask's code.  Its launch, buffers and other two kernels are sk_attn_bwd's."""

    head_dim: int
    warpgroups: int = 2
    mask: bool = False

    @property
    def block_m(self) -> int:
        """Query rows per tile (the padding of the lse, delta and dQ buffers)."""
        return 64

    @property
    def block_n(self) -> int:
        """Keys per block (64 per warpgroup; 64 above head dimension 128)."""
        return 64 if self.head_dim > 128 else 64 * self.warpgroups

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 128 * self.warpgroups

    def shared_bytes(self) -> int:
        """Dynamic shared memory: K and V, two stages of Q and dO, dS^T (16-bit), two stages
        of the rows' lse and delta (float32), and 1 KB to align the tiles to 1024 bytes (the
        128-byte swizzle needs it)."""
        d, n, m = self.head_dim, self.block_n, self.block_m
        return (2 * n * d + 4 * m * d + n * m) * 2 + 4 * m * 4 + 1024

    def name(self, dtype: str) -> str:
        """The C++ name expression of the backward kernel for ``dtype``."""
        return (f"sk_attn_bwd_sm90<{CTYPES[dtype]}, {self.head_dim}, {self.warpgroups}, "
                f"{'true' if self.mask else 'false'}>")

    def varlen_name(self, dtype: str) -> str:
        """The C++ name expression of the packed variable-length backward for ``dtype`` (the
        same tiles, never a boolean mask)."""
        return f"sk_attn_bwd_sm90_varlen<{CTYPES[dtype]}, {self.head_dim}, {self.warpgroups}>"


SM90_BACKWARD_CONFIGS = {
    32: Sm90BackwardConfig(32, warpgroups=1),
    64: Sm90BackwardConfig(64),
    96: Sm90BackwardConfig(96),
    128: Sm90BackwardConfig(128),
    192: Sm90BackwardConfig(192),
    256: Sm90BackwardConfig(256),
}
"""The Hopper backward for each head dimension it is built for, without a boolean mask: two
warpgroups, each with 64 keys of a 128-key block up to 128, and above (where a thread's dK and
dV accumulators would take D floats each) with half the columns of one 64-key block; at 32 one
warpgroup of 64 keys, three blocks a multiprocessor (1.2x two warpgroups).  At 32, 96 and 192
(panels of 32 columns, kernels/wgmma.cuh) the tiles beat the mma.sync kernel and the next
Hopper width zero-padded: 1.4x at 32, 1.03-1.15x at 96, 1.27-1.35x at 192 (bfloat16 B4 H32
L4096 on an H100, tools/backward_tiles.py, docs/benchmarks-attention.md)."""

SM90_BACKWARD_HEAD_DIMS = tuple(SM90_BACKWARD_CONFIGS)
"""Head dims the Hopper backward is declared for."""

SM90_BACKWARD_MASKED_CONFIGS = {d: replace(c, mask=True)
                                for d, c in SM90_BACKWARD_CONFIGS.items()}
"""The Hopper backward for calls with a boolean mask."""

SM90_BACKWARD_ALTERNATIVES = (Sm90BackwardConfig(32),)
"""Other Hopper backward tiles, built on request only (tools/backward_tiles.py times them): at
32 with two warpgroups of 64 keys."""

SM90_VARLEN_BACKWARD_CONFIGS = SM90_BACKWARD_CONFIGS
"""The packed variable-length backward on the Hopper kernel: the dense tiles at every head
dimension they are built for."""


def sm90_backward_config(head_dim: int, masked: bool) -> Sm90BackwardConfig | None:
    """The Hopper backward configuration for ``head_dim``, for a call with a boolean mask or
    without one, or None where none is built."""
    return (SM90_BACKWARD_MASKED_CONFIGS if masked else SM90_BACKWARD_CONFIGS).get(head_dim)


def sm90_backward_names() -> tuple[str, ...]:
    """The name expressions of the dense kernels of kernels/attention_bwd_sm90.cu (one
    module)."""
    declared = (*SM90_BACKWARD_CONFIGS.values(), *SM90_BACKWARD_MASKED_CONFIGS.values())
    return tuple(c.name(t) for c in declared for t in ATTENTION_DTYPES)


def sm90_varlen_backward_names() -> tuple[str, ...]:
    """The name expressions of the packed variable-length Hopper backward (a module of
    kernels/attention_bwd_sm90.cu of their own; its first and last kernels are the mma.sync
    backward's, :func:`varlen_backward_names`)."""
    return tuple(c.varlen_name(t) for c in SM90_VARLEN_BACKWARD_CONFIGS.values()
                 for t in ATTENTION_DTYPES)


DECODE_ROWS = 16
"""Split-KV decoding serves calls with (Hq / Hk) * Lq <= 16 query rows per key head."""

SM_SHARED_BYTES = 228 * 1024
"""Shared memory of a multiprocessor on the H100 / H200, 1 KiB of it reserved per block."""


def decode_holds(hq: int, hk: int, lq: int) -> bool:
    """Whether the split-KV decode kernels hold a call's ``(Hq / Hk) * Lq`` query rows per key
    head (at most :data:`DECODE_ROWS`)."""
    return (hq // hk) * lq <= DECODE_ROWS


@dataclass(frozen=True)
class DecodeConfig:
    """One split-KV decode shape: ``warps`` warps of 16 keys each (``block_n`` keys a tile),
    K and V tiles in a ring of ``stages`` (``stages - 1`` tiles in flight while one is read)."""

    head_dim: int
    warps: int = 4
    stages: int = 3

    @property
    def block_n(self) -> int:
        """Keys per tile."""
        return 16 * self.warps

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: the Q rows and the ring of K and V tiles, or the warps'
        float32 summaries when they merge, whichever is larger."""
        tiles = (DECODE_ROWS + 2 * self.stages * self.block_n) * self.head_dim * 2
        reduction = self.warps * DECODE_ROWS * (self.head_dim + 2) * 4
        return max(tiles, reduction)

    def resident(self) -> int:
        """Blocks a multiprocessor holds at once, by shared memory."""
        return max(1, SM_SHARED_BYTES // (self.shared_bytes() + 1024))

    def name(self, dtype: str, paged: bool = False) -> str:
        """The C++ name expression of the dense (or ``paged``) decode kernel for ``dtype``."""
        kernel = "sk_attn_decode_paged" if paged else "sk_attn_decode"
        return f"{kernel}<{CTYPES[dtype]}, {self.head_dim}, {self.warps}, {self.stages}>"


DECODE_CONFIGS = {d: DecodeConfig(d, warps=4, stages=2) for d in (32, 64, 80, 96, 128, 160,
                                                               192, 256)}
"""The decode configuration for each head dimension.  Blocks resident at once count for more
than stages: on the H200 at D = 128 two stages (three blocks a multiprocessor) read K and V
at 103% of the copy bandwidth, three stages (two blocks) at 90%, four (one block) at 58%
(docs/benchmarks-cupy.md)."""

DECODE_ALTERNATIVES = (
    *(DecodeConfig(128, warps=w, stages=s) for w, s in ((4, 3), (2, 2), (2, 3), (2, 4), (8, 2))),
    *(DecodeConfig(64, warps=w, stages=s) for w, s in ((4, 3), (2, 3), (8, 2))),
)
"""Other decode configurations (gpu_check.py compares them), built on request only."""


FITTING_DECODE_CONFIGS = {d: DecodeConfig(d, warps=2, stages=2) for d in (192, 256)}
"""Decode tiles for devices whose blocks may take less shared memory than
:data:`DECODE_CONFIGS`' need (99 KB on compute capability 8.6, 8.9 and 12.0): 32-key tiles,
54 and 72 KB."""


def decode_config(head_dim: int, shared_limit: int | None = None) -> DecodeConfig:
    """The decode configuration for ``head_dim`` (a key of :data:`DECODE_CONFIGS`) on a device
    whose blocks may take ``shared_limit`` bytes of shared memory (None: no limit)."""
    return fitting(DECODE_CONFIGS[head_dim], FITTING_DECODE_CONFIGS.get(head_dim), shared_limit)


def decode_alternative_names() -> tuple[str, ...]:
    """Name expressions of the alternative decode configurations (a module of their own)."""
    return tuple(c.name(t, paged) for c in DECODE_ALTERNATIVES for t in ATTENTION_DTYPES
                 for paged in (False, True))


MERGE_DTYPES = ("float16", "bfloat16", "float32")


def paged_names() -> tuple[str, ...]:
    """The name expressions of the paged decode kernels (a module of kernels/attention.cu of
    their own, so dense calls do not build them, nor paged calls the dense tiles)."""
    return tuple(decode_config(d).name(t, paged=True) for d in ATTENTION_HEAD_DIMS
                 for t in ATTENTION_DTYPES)


MASK_BITS_NAME = "sk_mask_bits<unsigned char>"
"""The name expression of the packing of boolean attention masks to bits."""


def merge_name(din: str, dout: str) -> str:
    """The name expression of the merge of partial attention states."""
    return f"sk_merge_attn<{CTYPES[din]}, {CTYPES[dout]}>"


def attention_names() -> tuple[str, ...]:
    """Every name expression of kernels/attention.cu (one module holds them all)."""
    declared = (*ATTENTION_CONFIGS.values(), *UNMASKED_CONFIGS.values())
    names = [c.name(t) for c in declared for t in ATTENTION_DTYPES]
    names += [decode_config(d).name(t) for d in ATTENTION_HEAD_DIMS for t in ATTENTION_DTYPES]
    names += [merge_name(t, t) for t in MERGE_DTYPES]
    names += [merge_name("float32", t) for t in ATTENTION_DTYPES]
    return tuple(names)


@dataclass(frozen=True)
class BackwardConfig:
    """One backward tile shape: ``warps`` warps, ``split`` of them on each 16 keys (``block_n``
    keys per block), query tiles of ``block_m`` rows."""

    head_dim: int
    warps: int = 8
    block_m: int = 64

    @property
    def split(self) -> int:
        """Warps sharing 16 keys, each with its share of the head dimension's dK and dV
        columns: 2 above D = 128 (the kernel derives it from D the same way)."""
        return 2 if self.head_dim > 128 else 1

    @property
    def block_n(self) -> int:
        """Keys per block (each ``split`` warps own 16)."""
        return 16 * self.warps // self.split

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: K, V, two stages of Q and dO, dS^T (16-bit), and two stages
        of the rows' lse and delta (float32)."""
        d, n, m = self.head_dim, self.block_n, self.block_m
        return (2 * n * d + 4 * m * d + n * m) * 2 + 4 * m * 4

    def name(self, dtype: str) -> str:
        """The C++ name expression of the backward kernel for ``dtype``."""
        return f"sk_attn_bwd<{CTYPES[dtype]}, {self.head_dim}, {self.warps}, {self.block_m}>"

    def varlen_name(self, dtype: str) -> str:
        """The C++ name expression of the packed variable-length backward for ``dtype``."""
        return (f"sk_attn_bwd_varlen<{CTYPES[dtype]}, {self.head_dim}, {self.warps}, "
                f"{self.block_m}>")


BACKWARD_CONFIGS = {
    32: BackwardConfig(32, warps=4, block_m=64),
    64: BackwardConfig(64, warps=4, block_m=64),
    80: BackwardConfig(80, warps=4, block_m=64),
    96: BackwardConfig(96, warps=8, block_m=64),
    128: BackwardConfig(128, warps=8, block_m=64),
    160: BackwardConfig(160, warps=8, block_m=64),
    192: BackwardConfig(192, warps=8, block_m=32),
    256: BackwardConfig(256, warps=8, block_m=32),
}
"""The backward configuration used for each head dimension.  Above 128 two warps share each
16 keys (:attr:`BackwardConfig.split`), 64 keys per block; 192 and 256 take 32-row query tiles
(their 64-row tiles spill registers).  At 32, 32-row query tiles measured faster on an H100
(bfloat16 B4 H32 L4096, dense only: 144 / 130 TFLOP/s plain / causal against 126 / 128 on
these 64-row tiles; 8 warps on 128-row tiles 145 / 130 in four times the shared memory);
a second run (6 December, tools/backward_tiles.py) gave 151 / 142 against 148 / 140, so they
stay among the alternatives.  At 160 the four-warp tiles measured 23-25% slower than these
(docs/benchmarks-attention.md, "Backward tiles at 32 and 192")."""

BACKWARD_ALTERNATIVES = (
    BackwardConfig(32, warps=4, block_m=32),
    BackwardConfig(32, warps=8, block_m=128),
    BackwardConfig(64, warps=8, block_m=64),
    BackwardConfig(128, warps=4, block_m=64),
    BackwardConfig(128, warps=8, block_m=32),
    BackwardConfig(160, warps=4, block_m=32),
    BackwardConfig(160, warps=4, block_m=64),
)
"""Other backward configurations, built on request only (gpu_check.py compares them)."""


FITTING_BACKWARD_CONFIGS = {d: BackwardConfig(d, warps=4, block_m=32)
                            for d in (96, 128, 160, 192, 256)}
"""Backward tiles for devices whose blocks may take less shared memory than
:data:`BACKWARD_CONFIGS`' need (99 KB on compute capability 8.6, 8.9 and 12.0): four warps
on 32-row query tiles, 52 to 99 KB."""


def backward_config(head_dim: int, shared_limit: int | None = None) -> BackwardConfig:
    """The backward configuration for ``head_dim`` (a key of :data:`BACKWARD_CONFIGS`) on a
    device whose blocks may take ``shared_limit`` bytes of shared memory (None: no limit)."""
    return fitting(BACKWARD_CONFIGS[head_dim], FITTING_BACKWARD_CONFIGS.get(head_dim),
                   shared_limit)


def attention_shared_bytes(head_dim: int, kind: str, shared_limit: int | None = None) -> int:
    """The most dynamic shared memory a block of the mma.sync attention kernels at
    ``head_dim`` (a built head dimension) takes on a device whose blocks may take
    ``shared_limit`` bytes (None: no limit), for ``kind``: ``"forward"`` (the masked tiles,
    which every call may take, and split-KV decoding's), ``"decode"`` (split-KV decoding's
    alone: paged decoding), ``"varlen"`` (the packed forward's tiles) or ``"backward"``.  A
    device of compute capability 9.0 gives 227 KB, enough for every default tile; 8.0 gives
    163 KB, 8.6, 8.9 and 12.0 give 99 KB, where the fitting tiles take over."""
    if kind == "forward":
        return max(attention_config(head_dim, shared_limit=shared_limit).shared_bytes(),
                   decode_config(head_dim, shared_limit).shared_bytes())
    if kind == "decode":
        return decode_config(head_dim, shared_limit).shared_bytes()
    if kind == "varlen":
        return varlen_config(head_dim, shared_limit).shared_bytes()
    if kind == "backward":
        return backward_config(head_dim, shared_limit).shared_bytes()
    raise ValueError(f"kind must be 'forward', 'decode', 'varlen' or 'backward', not {kind!r}")


def backward_pre_group(head_dim: int) -> int:
    """Threads per row of the backward's row preprocessing: one per 16-byte chunk, rounded up
    to a power of two (``sk_pre_group`` in kernels/attention_bwd.cu)."""
    group = 1
    while group < head_dim // 8:
        group *= 2
    return group


def backward_pre_name(dtype: str, head_dim: int) -> str:
    """The name expression of the backward's row preprocessing (lse in log2, delta)."""
    return f"sk_attn_bwd_pre<{CTYPES[dtype]}, {head_dim}>"


def backward_dq_name(dtype: str, head_dim: int) -> str:
    """The name expression of the backward's dQ conversion (float32 sums to the dtype)."""
    return f"sk_attn_bwd_dq<{CTYPES[dtype]}, {head_dim}>"


def backward_names() -> tuple[str, ...]:
    """Every name expression of kernels/attention_bwd.cu the backend uses by default."""
    names = [c.name(t) for c in BACKWARD_CONFIGS.values() for t in ATTENTION_DTYPES]
    for d in ATTENTION_HEAD_DIMS:
        names += [backward_pre_name(t, d) for t in ATTENTION_DTYPES]
        names += [backward_dq_name(t, d) for t in ATTENTION_DTYPES]
    return tuple(names)


def backward_alternative_names() -> tuple[str, ...]:
    """Name expressions of the alternative backward configurations (a module of their own)."""
    return tuple(c.name(t) for c in BACKWARD_ALTERNATIVES for t in ATTENTION_DTYPES)


def varlen_config(head_dim: int, shared_limit: int | None = None) -> AttentionConfig:
    """The packed variable-length forward's configuration for ``head_dim`` on a device whose
    blocks may take ``shared_limit`` bytes of shared memory (None: no limit): the unmasked
    dense one (varlen attention has no boolean mask)."""
    return attention_config(head_dim, masked=False, shared_limit=shared_limit)


def varlen_names() -> tuple[str, ...]:
    """The name expressions of the packed variable-length forward (a module of
    kernels/attention.cu of their own, so dense calls do not build them, nor these calls the
    dense ones)."""
    return tuple(varlen_config(d).varlen_name(t)
                 for d in ATTENTION_HEAD_DIMS for t in ATTENTION_DTYPES)


def backward_pre_varlen_name(dtype: str, head_dim: int) -> str:
    """The name expression of the packed backward's row preprocessing."""
    return f"sk_attn_bwd_pre_varlen<{CTYPES[dtype]}, {head_dim}>"


def backward_dq_varlen_name(dtype: str, head_dim: int) -> str:
    """The name expression of the packed backward's dQ conversion."""
    return f"sk_attn_bwd_dq_varlen<{CTYPES[dtype]}, {head_dim}>"


def varlen_backward_names() -> tuple[str, ...]:
    """The name expressions of the packed variable-length backward (a module of
    kernels/attention_bwd.cu of their own)."""
    names = []
    for d in ATTENTION_HEAD_DIMS:
        for t in ATTENTION_DTYPES:
            names += [backward_config(d).varlen_name(t), backward_pre_varlen_name(t, d),
                      backward_dq_varlen_name(t, d)]
    return tuple(names)


GRAD_OPS = {"softmax_vjp": 3, "log_softmax_vjp": 4, "cross_entropy": None}
"""Row operations of kernels/rowgrads.cu (VJPs with the kernel's OP argument)."""

GRAD_CONFIGS: tuple[RowConfig, ...] = tuple(
    RowConfig(threads, group, k)
    for threads, group, k in ((256, 4, 4), (256, 16, 4), (256, 32, 4), (128, 128, 4),
                              (256, 256, 4), (512, 512, 4), (512, 512, 8))
)
"""One block (or less) per row, ordered by capacity; longer rows are declined."""


def grad_config(n: int, itemsize: int) -> RowConfig | None:
    """The smallest gradient-kernel configuration that holds a row of ``n`` elements."""
    return _holding(GRAD_CONFIGS, n, itemsize)


def grad_name(op: str, dtype: str, config: RowConfig) -> str:
    """The C++ name expression of a gradient kernel."""
    tail = f"{config.threads}, {config.group}, {config.k}>"
    if op == "cross_entropy":
        return f"sk_xent<{CTYPES[dtype]}, {tail}"
    return f"sk_vjp<{CTYPES[dtype]}, {GRAD_OPS[op]}, {tail}"


def grad_modules() -> list[tuple[str, str, list[str]]]:
    """Every gradient module: ``(op, dtype, name_expressions)``."""
    return [
        (op, dtype, [grad_name(op, dtype, c) for c in GRAD_CONFIGS])
        for op in GRAD_OPS
        for dtype in CTYPES
    ]


def fitting_names() -> tuple[str, ...]:
    """The name expressions of the forward, packed forward and (dense and paged) decode
    kernels on the fitting tiles (a module of kernels/attention.cu of their own, built on
    devices with too little shared memory for the others)."""
    names = [n for c in FITTING_CONFIGS.values() for t in ATTENTION_DTYPES
             for n in (c.name(t), c.varlen_name(t))]
    names += [c.name(t, paged) for c in FITTING_DECODE_CONFIGS.values()
              for t in ATTENTION_DTYPES for paged in (False, True)]
    return tuple(names)


def fitting_backward_names() -> tuple[str, ...]:
    """The name expressions of the dense and packed backward on the fitting tiles (a module
    of kernels/attention_bwd.cu of their own)."""
    return tuple(n for c in FITTING_BACKWARD_CONFIGS.values() for t in ATTENTION_DTYPES
                 for n in (c.name(t), c.varlen_name(t)))


def all_modules() -> list[tuple[str, list[str]]]:
    """Every ``(source file, name expressions)`` module the backend may build on a device."""
    modules = [("rows.cu", names) for _, _, _, names in row_modules()]
    modules += [("rowgrads.cu", names) for _, _, names in grad_modules()]
    modules.append(("attention.cu", list(attention_names())))
    modules.append(("attention_bwd.cu", list(backward_names())))
    modules.append(("attention.cu", list(varlen_names())))
    modules.append(("attention_bwd.cu", list(varlen_backward_names())))
    modules.append(("attention.cu", list(paged_names())))
    modules.append(("attention.cu", list(fitting_names())))
    modules.append(("attention_bwd.cu", list(fitting_backward_names())))
    modules.append(("mask_bits.cu", [MASK_BITS_NAME]))
    modules.append(("attention_sm90.cu", list(sm90_names())))
    modules.append(("attention_bwd_sm90.cu", list(sm90_backward_names())))
    modules.append(("attention_sm90.cu", list(sm90_varlen_names())))
    modules.append(("attention_bwd_sm90.cu", list(sm90_varlen_backward_names())))
    modules.append(("attention_f32.cu", list(f32_names(fitting=False))))
    modules.append(("attention_f32.cu", list(f32_names(fitting=True))))
    modules.append(("attention_f32.cu", list(f32_backward_names(wide=False))))
    modules.append(("attention_f32.cu", list(f32_backward_names(wide=True))))
    modules.append(("attention_f32.cu", list(f32_backward_pre_names())))
    modules.append(("attention_f32.cu", list(f32_varlen_names())))
    modules.append(("attention_f32.cu", list(f32_varlen_backward_names())))
    modules.append(("attention_f32.cu", list(f32_decode_names())))
    modules.append(("attention_tf32.cu", list(tf32_names())))
    modules.append(("attention_tf32.cu", list(tf32_backward_names())))
    modules.append(("attention_tf32.cu", list(tf32_backward_pre_names())))
    return modules


@dataclass(frozen=True)
class F32Config:
    """One tile shape of the exact float32 forward on CUDA cores (kernels/attention_f32.cu):
    ``warps`` warps of row groups of ``lanes`` lanes (8 or 16), each lane ``rows`` query rows
    (a warp's rows: ``32 / lanes * rows``), ``block_n`` keys per tile, key head dimension
    ``head_dim`` and value head dimension ``value_dim``, ``v_stages`` stages of the value tile
    (one: a tile's V loads over its scores, two: over the last tile's P V), ``k_stages`` of
    the key tile (two: the next tile's K loads over this tile's scores and P V, one, with one
    stage of V: over its P V alone); ``mask=False`` builds it without boolean-mask support."""

    head_dim: int
    value_dim: int
    warps: int = 4
    block_n: int = 32
    mask: bool = True
    rows: int = 4
    lanes: int = 8
    v_stages: int = 2
    k_stages: int = 2

    @property
    def block_m(self) -> int:
        """Query rows per block."""
        return 32 // self.lanes * self.rows * self.warps

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: the Q tile, ``k_stages`` of K tiles and ``v_stages`` of V
        tiles (rows padded by 4 floats) and the warps' probability tiles (rows of ``block_n +
        lanes`` floats)."""
        d, dv, bm, bn = self.head_dim, self.value_dim, self.block_m, self.block_n
        return 4 * ((bm + self.k_stages * bn) * (d + 4) + self.v_stages * bn * (dv + 4)
                    + bm * (bn + self.lanes))

    def _tail(self) -> str:
        """The template's last arguments (rows, lanes, V and K stages) where not its
        defaults."""
        extra = [self.rows, self.lanes, self.v_stages, self.k_stages]
        while extra and extra[-1] == (4, 8, 2, 2)[len(extra) - 1]:
            extra.pop()
        return "".join(f", {x}" for x in extra)

    def name(self) -> str:
        """The C++ name expression of the kernel."""
        return (f"sk_attn_fwd_f32<{self.head_dim}, {self.value_dim}, {self.warps}, "
                f"{self.block_n}, {'true' if self.mask else 'false'}{self._tail()}>")

    def varlen_name(self) -> str:
        """The C++ name expression of the packed variable-length kernel on these tiles (it
        takes no mask)."""
        return (f"sk_attn_fwd_f32_varlen<{self.head_dim}, {self.value_dim}, {self.warps}, "
                f"{self.block_n}{self._tail()}>")


F32_CONFIGS = {
    (32, 32): F32Config(32, 32, warps=4, block_n=64),
    (64, 64): F32Config(64, 64, warps=4, block_n=64),
    (80, 96): F32Config(80, 96, warps=8, block_n=64, v_stages=1),
    (96, 96): F32Config(96, 96, warps=8, block_n=64, v_stages=1),
    (128, 128): F32Config(128, 128, warps=8, block_n=64, rows=8, lanes=16, v_stages=1),
    (160, 160): F32Config(160, 160, warps=8, block_n=32),
    (192, 128): F32Config(192, 128, warps=8, block_n=32),
    (192, 192): F32Config(192, 192, warps=8, block_n=32, v_stages=1),
    (256, 256): F32Config(256, 256, warps=8, block_n=32, lanes=16, v_stages=1),
}
"""The exact float32 forward for each (key, value) head dimension pair it is built for, with
the boolean mask's code and without it on the same tiles.  Other pairs run on copies
zero-padded to the built pair of least width that holds them (:func:`f32_shape`).  (80, 96)
takes calls at head dim 80 with q and k as they are and v alone zero-padded (a row group's
lanes take the output's columns four at a time, so Dv must be a multiple of 32, D only of
4).  At 80 and 96, eight warps of 64-key tiles and one stage of V (145 and 161 KB): on an
H100 at 80 1.04-1.25x torch's efficient backend, where four warps of 32 keys on the same pair
gave 0.95-1.17x and the pad of all three to 96 0.83-0.97x; at 96 1.01x / 0.98x without
causality (L1024 / L4096) where four warps of 32 keys gave 0.92x / 0.89x, 1.21x / 1.04x with
it (1.25x / 1.00x) (docs/benchmarks-attention.md, "float32 at head dims 80 and 96").  At 128 a
block is eight warps of 16 rows, a lane 8 rows of 4 keys and 8 output columns (rows of 16
lanes): 12.8 fma per shared-memory read against the four-row tile's 9.8, one block of 205 KB
a multiprocessor; on an H100 1.13-1.17x the four-row tile (docs/benchmarks-attention.md,
"float32: causal blocks longest first, eight rows a lane at head dim 128").  Above 128,
eight warps in 174-200 KB (one stage of V at 192, 16-lane rows at 256): on an H100
1.18-1.60x the four-warp tiles of 133-205 KB, whose one block of four warps a
multiprocessor left each scheduler a single warp (docs/benchmarks-attention.md, "float32
above head dim 128")."""

FITTING_F32_CONFIGS = {
    (80, 96): F32Config(80, 96, warps=4, block_n=32),
    (96, 96): F32Config(96, 96, warps=4, block_n=32),
    (128, 128): F32Config(128, 128, warps=4, block_n=32),
    (160, 160): F32Config(160, 160, warps=4, block_n=32),
    (192, 128): F32Config(192, 128, warps=4, block_n=32),
    (192, 192): F32Config(192, 192, warps=4, block_n=32),
}
"""The exact float32 forward tiles for devices whose blocks may take less shared memory than
:data:`F32_CONFIGS`' need (compute capability 8.0's 163 KB and less): four warps, 77 KB at
80 and 96, 109 KB at 128 and 133-157 KB above."""


F32_ALTERNATIVES = (
    F32Config(64, 64, warps=4, block_n=32, mask=False, rows=8),
    F32Config(256, 256, warps=4, block_n=32, mask=False, rows=8, lanes=16, v_stages=1),
    F32Config(256, 256, warps=8, block_n=32, mask=False, lanes=16),
    F32Config(256, 256, warps=8, block_n=64, lanes=16, v_stages=1, k_stages=1),
    F32Config(256, 256, warps=8, block_n=64, mask=False, rows=2, v_stages=1, k_stages=1),
    F32Config(192, 128, warps=8, block_n=64, mask=False, v_stages=1, k_stages=1),
    F32Config(192, 192, warps=8, block_n=64, mask=False, rows=2, v_stages=1, k_stages=1),
    F32Config(160, 160, warps=8, block_n=64, mask=False, v_stages=1, k_stages=1),
    F32Config(128, 128, warps=8, block_n=64, mask=False, v_stages=1),
)
"""Other exact float32 forward tiles, built on request only (``config=``), for
tools/tf32_timing.py to time beside the declared ones.  Eight rows a lane at head dim 64:
12.8 fma per shared-memory read against 10.7, 8% faster than the declared tile without
causality and 6-12% slower with it on an H100 (docs/benchmarks-attention.md).  At 128,
eight-row tiles of 8-lane row groups (2 or 4 warps, 255 registers) and 64-key four-row tiles
were slower there; the declared tile takes its eight rows a lane in 16-lane groups.  At 192,
eight rows a lane in 16-lane groups (195 KB) was 1-3% slower there than the declared tile.
At 256, where the declared tile stays below torch's efficient backend, four warps of eight
rows a lane (174 KB, 246 registers: 22.1-26.2 TFLOP/s against the declared tile's
27.5-30.8 on an H100) and the declared tile with two stages of V (207 KB: within 2% of it).
Tiles of 64 keys with one stage of K and of V, the next K loading over a tile's P V alone
(above 128, where two stages of 64-key K tiles do not fit beside the Q tile): a lane's scores
take 4-8 keys of a tile where the declared tiles take 2-4, fewer shared-memory reads a fma,
and each tile's softmax serves twice the keys; at 128, the eight-warp tile of 80 and 96."""

@dataclass(frozen=True)
class F32BackwardConfig:
    """The exact float32 backward's tile shape (kernels/attention_f32.cu, sk_attn_bwd_f32):
    ``warps`` warps of ``4 keys`` keys each (``keys`` a lane), query tiles of ``block_m``
    rows; ``mask=False`` builds it without the boolean mask's code."""

    head_dim: int
    value_dim: int
    warps: int = 4
    block_m: int = 32
    mask: bool = True
    keys: int = 4

    @property
    def block_n(self) -> int:
        """Keys per block (``4 keys`` a warp)."""
        return 4 * self.keys * self.warps

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: K and V, two stages of Q and dO (rows padded by 4 floats),
        P^T / dS^T (rows of ``block_m + 8``) and two stages of the rows' lse2 and delta."""
        d, dv, bm, bn = self.head_dim, self.value_dim, self.block_m, self.block_n
        return 4 * ((bn + 2 * bm) * (d + dv + 8) + bn * (bm + 8) + 4 * bm)

    def name(self) -> str:
        """The C++ name expression of the kernel."""
        return (f"sk_attn_bwd_f32<{self.head_dim}, {self.value_dim}, {self.warps}, "
                f"{self.block_m}, {'true' if self.mask else 'false'}"
                f"{'' if self.keys == 4 else f', {self.keys}'}>")

    def varlen_name(self) -> str:
        """The C++ name expression of the packed variable-length kernel on these tiles (it
        takes no mask)."""
        return (f"sk_attn_bwd_f32_varlen<{self.head_dim}, {self.value_dim}, {self.warps}, "
                f"{self.block_m}{'' if self.keys == 4 else f', {self.keys}'}>")


F32_BACKWARD_CONFIGS = {
    (32, 32): F32BackwardConfig(32, 32, warps=4, block_m=32),
    (64, 64): F32BackwardConfig(64, 64, warps=4, block_m=32),
    (96, 96): F32BackwardConfig(96, 96, warps=4, block_m=32),
    (128, 128): F32BackwardConfig(128, 128, warps=4, block_m=16),
    (160, 160): F32BackwardConfig(160, 160, warps=8, block_m=32, keys=2),
    (192, 128): F32BackwardConfig(192, 128, warps=8, block_m=16, keys=2),
    (192, 192): F32BackwardConfig(192, 192, warps=8, block_m=16, keys=2),
    (256, 256): F32BackwardConfig(256, 256, warps=8, block_m=16, keys=2),
}
"""The exact float32 backward for each (key, value) head dimension pair it is built for,
with the boolean mask's code and without it.  Up to 128, four warps of four keys a lane
(dK and dV in 16 (D + Dv) / 32 registers), two blocks a multiprocessor; above, eight warps
of two keys a lane (8 (D + Dv) / 32 registers), one block of 132-206 KB a multiprocessor
(at 160, where a warp takes a whole column group of dQ, query tiles of 32 rows).  Other
pairs run zero-padded to the built pair of least width that holds them
(:func:`f32_backward_shape`)."""

F32_BACKWARD_ALTERNATIVES = (
    F32BackwardConfig(192, 192, warps=8, block_m=32, mask=False, keys=2),
    F32BackwardConfig(192, 128, warps=8, block_m=32, mask=False, keys=2),
)
"""Other exact float32 backward tiles, built on request only (``config=``), for
tools/f32_backward_timing.py to time beside the declared ones: at 192 and 192/128, query tiles
of 32 rows as at 160 (211 and 179 KB, 210 and 185 registers), where a lane's S^T and dP^T take
four queries of a tile against the 16-row tiles' two (six shared-memory reads for 32 fma
against four for 16)."""

WIDE_BACKWARD = 128
"""The widest head dim of the four-key backward tiles: the wider tiles are a module of their
own (:func:`f32_backward_names`), so that a gradient at the common head dims builds none."""


def f32_backward_shape(d: int, dv: int) -> tuple[int, int] | None:
    """The (key, value) head dimensions of ``F32_BACKWARD_CONFIGS`` a float32 gradient of
    ``d`` and ``dv`` runs at (as :func:`f32_shape`), or None."""
    return _pair_shape(F32_BACKWARD_CONFIGS, d, dv)


def f32_backward_config(d: int, dv: int, masked: bool) -> F32BackwardConfig | None:
    """The exact float32 backward configuration built for (``d``, ``dv``), or None."""
    return _pair_config(F32_BACKWARD_CONFIGS, d, dv, masked)


def f32_backward_names(wide: bool | None = None) -> tuple[str, ...]:
    """The name expressions of the exact float32 backward: the tiles up to head dim
    :data:`WIDE_BACKWARD` (``wide=False``, a module) or above it (``wide=True``, a module of
    their own), or both (None)."""
    return _pair_names({pair: c for pair, c in F32_BACKWARD_CONFIGS.items()
                        if wide is None or (pair[0] > WIDE_BACKWARD) is wide})


def f32_backward_pre_names() -> tuple[str, ...]:
    """The name expressions of the float32 backward's row preprocessing (lse in log2 units and
    delta, kernels/bwd_pre.cuh) at each value head dim of ``F32_BACKWARD_CONFIGS``, a module
    of kernels/attention_f32.cu of their own."""
    dvs = {dv for _, dv in F32_BACKWARD_CONFIGS}
    return tuple(backward_pre_name("float32", dv) for dv in sorted(dvs))


def f32_varlen_names() -> tuple[str, ...]:
    """The name expressions of the exact float32 packed variable-length forward, on the tiles
    of :data:`F32_CONFIGS` and :data:`FITTING_F32_CONFIGS`: a module of its own."""
    configs = (*F32_CONFIGS.values(), *FITTING_F32_CONFIGS.values())
    return tuple(dict.fromkeys(c.varlen_name() for c in configs))


def f32_varlen_backward_names() -> tuple[str, ...]:
    """The name expressions of the exact float32 packed variable-length backward on the tiles
    of :data:`F32_BACKWARD_CONFIGS`, with its row preprocessing
    (``sk_attn_bwd_pre_varlen<float, Dv>``): a module of its own."""
    dvs = sorted({dv for _, dv in F32_BACKWARD_CONFIGS})
    return (*(c.varlen_name() for c in F32_BACKWARD_CONFIGS.values()),
            *(backward_pre_varlen_name("float32", dv) for dv in dvs))


@dataclass(frozen=True)
class F32DecodeConfig:
    """One shape of the float32 split-KV decode kernels (kernels/attention_f32.cu,
    ``sk_attn_decode_f32``, ``sk_attn_decode_f32_paged``): ``warps`` warps of ``16 / warps``
    query rows each, 32-key tiles in a ring of ``stages``; head dimension ``head_dim`` (D =
    Dv).  Duck-typed as :class:`DecodeConfig` for :func:`.attention.split_decode`."""

    head_dim: int
    warps: int = 4
    stages: int = 3

    block_n = 32
    """Keys per tile: one a lane."""

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: 16 query rows and the ring of K and V tiles, rows of
        ``head_dim + 4`` floats."""
        return 4 * (DECODE_ROWS + 2 * self.stages * self.block_n) * (self.head_dim + 4)

    def resident(self) -> int:
        """Blocks a multiprocessor holds at once, by shared memory."""
        return max(1, SM_SHARED_BYTES // (self.shared_bytes() + 1024))

    def name(self, dtype: str = "float32", paged: bool = False) -> str:
        """The C++ name expression of the dense (or ``paged``) kernel (float32 only)."""
        kernel = "sk_attn_decode_f32_paged" if paged else "sk_attn_decode_f32"
        return f"{kernel}<{self.head_dim}, {self.warps}, {self.stages}>"


F32_DECODE_CONFIGS = {
    32: F32DecodeConfig(32, warps=8, stages=2),
    64: F32DecodeConfig(64, warps=4, stages=4),
    96: F32DecodeConfig(96, warps=4, stages=2),
    128: F32DecodeConfig(128, warps=4, stages=2),
    160: F32DecodeConfig(160, warps=4, stages=2),
    192: F32DecodeConfig(192, warps=4, stages=2),
    256: F32DecodeConfig(256, warps=8, stages=2),
}
"""The float32 split-KV decode kernels that serve float32 decoding (dense calls of few query
rows per key head, :func:`.attention.uses_decode`, and paged calls that the decode kernels
hold, :func:`decode_holds`) at each head dimension they are built for (D = Dv; other pairs up
to 256 zero-padded to the next, :func:`f32_decode_width`): 20-113 KB of shared memory up to
192, 150 KB at 256.  Each is the fastest of the tiles timed on an H100 (B8 Hq32 Hk8 Lk8192,
``tools/f32_decode_timing.py --tiles``: 2, 4 or 8 warps, 2 to 4 stages; 22-68% of the copy
bandwidth where the exact forward read 4-9%, docs/benchmarks-attention.md)."""


def f32_decode_config(d: int, dv: int,
                      shared_limit: int | None = None) -> F32DecodeConfig | None:
    """The float32 decode tiles for ``d`` and ``dv`` (those of :data:`F32_DECODE_CONFIGS` at
    :func:`f32_decode_width`) where a block of them fits ``shared_limit`` bytes of shared
    memory (None: no limit), else None: such calls run on the exact forward instead."""
    width = f32_decode_width(d, dv)
    found = None if width is None else F32_DECODE_CONFIGS[width]
    if found is None or (shared_limit is not None and found.shared_bytes() > shared_limit):
        return None
    return found


def f32_decode_width(d: int, dv: int) -> int | None:
    """The head dimension of :data:`F32_DECODE_CONFIGS` a float32 decode of ``d`` and ``dv``
    runs at (zero-padded where it is not their own), or None above 256."""
    return next((w for w in sorted(F32_DECODE_CONFIGS) if w >= max(d, dv)), None)


def f32_decode_names() -> tuple[str, ...]:
    """The name expressions of the float32 decode kernels, dense and paged: a module of
    kernels/attention_f32.cu of their own."""
    return tuple(c.name("float32", paged) for c in F32_DECODE_CONFIGS.values()
                 for paged in (False, True))


_Pair = TypeVar("_Pair", F32Config, F32BackwardConfig)


def _pair_shape(table: dict[tuple[int, int], _Pair], d: int, dv: int
                ) -> tuple[int, int] | None:
    """The (key, value) pair of ``table`` a call of ``d`` and ``dv`` runs at: its own where
    built, else the pair that holds both (zero-padded) of least ``D + Dv`` (the work of a
    score and an output column together), a square pair before another of the same sum;
    None where none."""
    if (d, dv) in table:  # the common call: no search
        return d, dv
    holding = [(w, x) for w, x in table if w >= d and x >= dv]
    return min(holding, key=lambda p: (p[0] + p[1], max(p)), default=None)


def _pair_config(table: dict[tuple[int, int], _Pair], d: int, dv: int,
                 masked: bool) -> _Pair | None:
    """The configuration of ``table`` built for (``d``, ``dv``), without the boolean mask's
    code unless ``masked``; None where none is built."""
    found = table.get((d, dv))
    return found if found is None or masked else replace(found, mask=False)


def _pair_names(table: dict[tuple[int, int], _Pair]) -> tuple[str, ...]:
    """The name expressions of ``table``'s configurations, with and without the mask."""
    return tuple(c.name() for d, dv in table for masked in (True, False)
                 if (c := _pair_config(table, d, dv, masked)) is not None)


F32_SERVED = True
"""Whether the manifest serves float32 attention at ``precision="float32"`` on the forward
kernels here, and float32 ``attention_vjp`` at every precision on the backward kernels: on
an H100 (tests/test_f32_gpu.py against float64 on poisoned memory, every tile forward and
backward: 154 passed; B2 H16 eager) the forward ran at 21.6-36.7 TFLOP/s against
numba-cuda's 13.2-17.3, 2.1-2.5x; since the eight-row tile at 128 and causal blocks longest
first, 1.06-1.56x torch's efficient backend at head dim 64 and 0.93-1.13x at 128
(tools/tf32_timing.py); the backward at 1.4-2.1x numba-cuda's
(tools/f32_backward_timing.py)."""


def f32_shape(d: int, dv: int) -> tuple[int, int] | None:
    """The (key, value) head dimensions of ``F32_CONFIGS`` a float32 call of ``d`` and ``dv``
    runs at: its own pair where one is built, else the built pair of least width that holds
    both (on zero-padded copies, :func:`_pair_shape`); None where none does."""
    return _pair_shape(F32_CONFIGS, d, dv)


def f32_config(d: int, dv: int, masked: bool,
               shared_limit: int | None = None) -> F32Config | None:
    """The exact float32 forward configuration built for (``d``, ``dv``) on a device whose
    blocks may take ``shared_limit`` bytes of shared memory (None: no limit), or None."""
    found = F32_CONFIGS.get((d, dv))
    if found is None:
        return None
    found = fitting(found, FITTING_F32_CONFIGS.get((d, dv)), shared_limit)
    return found if masked else replace(found, mask=False)


def f32_names(fitting: bool | None = None) -> tuple[str, ...]:
    """The name expressions of the exact float32 forward: the tiles of :data:`F32_CONFIGS`
    (``fitting=False``, a module), those of :data:`FITTING_F32_CONFIGS` (``fitting=True``, a
    module of their own, which only a device of less shared memory builds), or both (None)."""
    tables = {False: F32_CONFIGS, True: FITTING_F32_CONFIGS}
    return tuple(n for which, table in tables.items() if fitting in (None, which)
                 for n in _pair_names(table))


def f32_alternative_names() -> tuple[str, ...]:
    """The name expressions of the exact float32 alternatives, forward and backward (a module
    of their own)."""
    declared = {*f32_names(), *f32_backward_names()}
    return tuple(n for n in dict.fromkeys(
        c.name() for c in (*F32_ALTERNATIVES, *F32_BACKWARD_ALTERNATIVES)) if n not in declared)


TF32_PRECISIONS = {"tf32": 1, "tf32x3": 3}
"""The ``precision=`` values kernels/attention_tf32.cu serves float32 calls at, with the products
each takes per product of the definition (its PRECISION template argument)."""

@dataclass(frozen=True)
class Tf32Config:
    """One tile shape of the float32 forward on TF32 tensor cores (kernels/attention_tf32.cu):
    ``warps`` warps of ``16 * m_tiles`` query rows, ``block_n`` keys per tile; ``mask=False``
    builds it without boolean-mask support; ``staged=True`` sums each key tile's ``P V`` apart
    and adds it to the output's accumulator in float32 at ``"tf32x3"`` (the kernel's STAGE)."""

    head_dim: int
    warps: int = 4
    block_n: int = 32
    m_tiles: int = 1
    mask: bool = True
    staged: bool = False

    @property
    def block_m(self) -> int:
        """Query rows per block."""
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: the Q tile and two stages of K and V tiles (float32)."""
        return (self.block_m + 4 * self.block_n) * self.head_dim * 4

    def name(self, precision: str) -> str:
        """The C++ name expression of the kernel at ``precision`` ("tf32" or "tf32x3")."""
        stage = self.staged and precision == "tf32x3"  # one product: nothing to stage
        return (f"sk_attn_fwd_tf32<{self.head_dim}, {self.warps}, {self.block_n}, "
                f"{self.m_tiles}, {'true' if self.mask else 'false'}, "
                f"{TF32_PRECISIONS[precision]}, {'true' if stage else 'false'}>")


TF32_CONFIGS = {
    32: Tf32Config(32, warps=4, block_n=64, m_tiles=1, staged=True),
    64: Tf32Config(64, warps=4, block_n=32, m_tiles=2, staged=True),
    96: Tf32Config(96, warps=4, block_n=32, m_tiles=1, staged=True),
    128: Tf32Config(128, warps=8, block_n=32, m_tiles=1, staged=True),
}
"""The float32 TF32 forward for each head dimension it is built for (D = Dv), each tile with
the boolean mask's code and without it.  Float32 tiles take twice the shared memory of 16-bit
ones, so the tiles are smaller than the 16-bit kernels': eight warps a multiprocessor, as two
blocks of four warps (up to 96 KB a block) or one of eight (head dim 128: 128 KB, where the
device's blocks may take it, :data:`FITTING_TF32_CONFIGS` otherwise).  On an H100 (B2 H16,
L1024 / L4096, eager, tools/tf32_timing.py, 2026-12-06) the tiles of 64 and 128 took
95.9 / 111.6 and 92.9 / 101.5 TFLOP/s at "tf32" against 73.7 / 82.6 (64: 64-key tiles, one
16-row tile a warp) and 78.9 / 86.0 (128: four warps).  ``"tf32x3"`` sums each key tile
apart (``staged``): on the H100 (D64 / D128, L1024) its relative error against float64 is
8.1e-7 / 1.3e-6 against 7.6e-6 / 7.9e-6 summing in place (float32 exact: 6.5e-7 / 7.0e-7),
at 1.03x / 0.97x the in-place time."""

FITTING_TF32_CONFIGS = {
    128: Tf32Config(128, warps=4, block_n=32, m_tiles=1, staged=True),
}
"""The TF32 forward tiles for devices whose blocks may take less shared memory than
:data:`TF32_CONFIGS`' need (99 KB on compute capability 8.6, 8.9 and 12.0): 96 KB."""

TF32_ALTERNATIVES = (
    Tf32Config(64, warps=4, block_n=64, m_tiles=1, mask=False, staged=True),
    Tf32Config(64, warps=8, block_n=64, m_tiles=1, mask=False, staged=True),
    # the served tiles summing in place at "tf32x3", for the cost and error of staging
    Tf32Config(64, warps=4, block_n=32, m_tiles=2, mask=False),
    Tf32Config(128, warps=8, block_n=32, m_tiles=1, mask=False),
)
"""Other TF32 forward configurations, built on request only (``config=``), for
tools/tf32_timing.py to time beside the declared ones."""


def tf32_width(d: int, dv: int) -> int | None:
    """The head dimension of ``TF32_CONFIGS`` a float32 call of key dim ``d`` and value dim
    ``dv`` runs at (the smallest that holds both, on zero-padded copies unless it is
    ``d == dv``), or None where none does."""
    return next((w for w in sorted(TF32_CONFIGS) if w >= max(d, dv)), None)


def tf32_serves(precision: str, d: int, dv: int) -> bool:
    """Whether a float32 call at ``precision`` of key dim ``d`` and value dim ``dv`` runs on
    the TF32 kernels: at "tf32" or "tf32x3" where they hold its head dims (:func:`tf32_width`).
    The exact float32 kernels take the others: exact products meet every precision's bound,
    and wider than the TF32 tiles they are the fastest this backend has."""
    return precision != "float32" and tf32_width(d, dv) is not None


def tf32_config(head_dim: int, masked: bool,
                shared_limit: int | None = None) -> Tf32Config | None:
    """The TF32 forward configuration for ``head_dim`` on a device whose blocks may take
    ``shared_limit`` bytes of shared memory (None: no limit), with the boolean mask's code
    where ``masked``; None where none is built."""
    found = TF32_CONFIGS.get(head_dim)
    if found is None:
        return None
    found = fitting(found, FITTING_TF32_CONFIGS.get(head_dim), shared_limit)
    return found if masked else replace(found, mask=False)


def tf32_names() -> tuple[str, ...]:
    """The name expressions of kernels/attention_tf32.cu (one module holds them all): every
    tile of :data:`TF32_CONFIGS` and :data:`FITTING_TF32_CONFIGS`, with and without the
    mask's code, at each precision."""
    tiles = (*TF32_CONFIGS.values(), *FITTING_TF32_CONFIGS.values())
    return tuple(dict.fromkeys(replace(c, mask=masked).name(p) for c in tiles
                               for masked in (True, False) for p in TF32_PRECISIONS))


def tf32_alternative_names() -> tuple[str, ...]:
    """The name expressions of the TF32 alternatives (a module of their own)."""
    declared = set(tf32_names())  # a staged tile's "tf32" kernel is the plain one's
    names = (c.name(p) for c in TF32_ALTERNATIVES for p in TF32_PRECISIONS)
    return tuple(n for n in dict.fromkeys(names) if n not in declared)


@dataclass(frozen=True)
class Tf32BackwardConfig:
    """The float32 TF32 backward's tile shape (kernels/attention_tf32.cu, sk_attn_bwd_tf32):
    ``warps`` warps of 16 keys each, query tiles of ``block_m`` rows; ``mask=False`` builds it
    without the boolean mask's code."""

    head_dim: int
    warps: int = 4
    block_m: int = 32
    mask: bool = True

    @property
    def block_n(self) -> int:
        """Keys per block (16 a warp)."""
        return 16 * self.warps

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Dynamic shared memory: K and V, two stages of Q and dO, dS^T (float32 rows padded
        by 4 floats), and two stages of the rows' lse2 and delta."""
        d, bm, bn = self.head_dim, self.block_m, self.block_n
        return (2 * bn + 4 * bm) * (d + 4) * 4 + bn * (bm + 4) * 4 + 4 * bm * 4

    def name(self, precision: str) -> str:
        """The C++ name expression of the kernel at ``precision`` ("tf32" or "tf32x3")."""
        return (f"sk_attn_bwd_tf32<{self.head_dim}, {self.warps}, {self.block_m}, "
                f"{'true' if self.mask else 'false'}, {TF32_PRECISIONS[precision]}>")


TF32_BACKWARD_CONFIGS = {
    32: Tf32BackwardConfig(32, warps=4, block_m=64),
    64: Tf32BackwardConfig(64, warps=4, block_m=32),
    96: Tf32BackwardConfig(96, warps=4, block_m=32),
    128: Tf32BackwardConfig(128, warps=4, block_m=16),
}
"""The float32 TF32 backward for each head dimension (within sm_80's shared memory; query
tiles as long as the registers allow without spills: dK and dV take D / 2 a thread).  Built
on request only (``softmaxkit_cupy.attention_tf32.attention_vjp``): compiled and checked for
registers in CI, it serves float32 gradients at reduced precision once a device run has
checked it against float64 (backends/cupy/tests/test_tf32_gpu.py); until then those run on
the exact kernels."""


def tf32_backward_config(head_dim: int, masked: bool) -> Tf32BackwardConfig | None:
    """The TF32 backward configuration for ``head_dim``, or None where none is built."""
    found = TF32_BACKWARD_CONFIGS.get(head_dim)
    if found is None or masked:
        return found
    return Tf32BackwardConfig(found.head_dim, found.warps, found.block_m, mask=False)


def tf32_backward_names() -> tuple[str, ...]:
    """The name expressions of the TF32 backward (a module of their own)."""
    return tuple(c.name(p) for d in TF32_BACKWARD_CONFIGS for masked in (True, False)
                 if (c := tf32_backward_config(d, masked)) is not None
                 for p in TF32_PRECISIONS)


def tf32_backward_pre_names() -> tuple[str, ...]:
    """The TF32 backward's row preprocessing (as :func:`f32_backward_pre_names`), a module of
    kernels/attention_tf32.cu of their own."""
    return tuple(backward_pre_name("float32", d) for d in sorted(TF32_BACKWARD_CONFIGS))
