"""The manifest, the entry point, can_run and the row plans: no GPU and no numba needed."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import numpy as np
import pytest
from softmaxkit_numba_cuda import plan
from softmaxkit_numba_cuda.manifest import can_run, manifest


def test_manifest_imports_no_numba():
    code = (
        "import sys, softmaxkit_numba_cuda as b; m = b.manifest(); "
        "assert m['name'] == 'numba-cuda'; "
        "bad = [k for k in sys.modules if k.split('.')[0] in ('numba', 'cupy')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_entry_point_names_the_manifest():
    found = [ep for ep in entry_points(group="softmaxkit.backends") if ep.name == "numba-cuda"]
    assert len(found) == 1
    assert found[0].load()()["name"] == "numba-cuda"


def test_manifest_serves_cuda_row_operations(monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    m = manifest()
    rows, summaries, merges, attention = m["serves"]
    for entry in (rows, summaries, merges):
        assert entry["devices"] == ["cuda"]
        assert set(entry["dtypes"]) == {"float16", "bfloat16", "float32", "float64"}
    served = {op for entry in m["serves"] for op in entry["ops"]}
    assert set(m["kernels"]) == served
    assert {"merge", "normalize", "merge_attention", "merge_attention_vjp"} <= served
    # exact attention on CUDA cores in float32 and float64; 16-bit stays with cupy
    assert attention["devices"] == ["cuda"]
    assert attention["ops"] == ["attention", "attention_vjp", "paged_attention",
                                "varlen_attention", "varlen_attention_vjp"]
    assert attention["dtypes"] == ["float32", "float64"]
    assert "16-bit attention" in importlib.import_module("softmaxkit_numba_cuda.manifest").__doc__


def test_attention_kernels_are_importable_by_name():
    m = manifest()
    for op in ("attention", "attention_vjp", "merge_attention", "merge_attention_vjp",
               "paged_attention", "varlen_attention", "varlen_attention_vjp"):
        module, name = m["kernels"][op].split(":")
        assert callable(getattr(importlib.import_module(module), name))


def _call(op, device, **args):
    return SimpleNamespace(op=op, device=device, args=args)


@pytest.mark.parametrize("op", ["attention", "attention_vjp"])
def test_can_run_declines_attention_head_dims_above_256(monkeypatch, op):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    q, v = np.zeros((1, 1, 2, 256)), np.zeros((1, 1, 3, 256))
    assert can_run(_call(op, "cpu", q=q, k=q, v=v)) is True
    verdict = can_run(_call(op, "cpu", q=q, k=q, v=np.zeros((1, 1, 3, 264))))
    assert isinstance(verdict, str) and "256" in verdict
    verdict = can_run(_call(op, "cpu", q=np.zeros((1, 1, 2, 320)), k=q, v=v))
    assert isinstance(verdict, str) and "D=320" in verdict


def test_can_run_declines_paged_head_dims_above_256(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    q, pages = np.zeros((1, 1, 1, 256)), np.zeros((2, 1, 4, 256))
    assert can_run(_call("paged_attention", "cpu", q=q, k_pages=pages, v_pages=pages)) is True
    verdict = can_run(_call("paged_attention", "cpu", q=q, k_pages=pages,
                            v_pages=np.zeros((2, 1, 4, 264))))
    assert isinstance(verdict, str) and "256" in verdict


@pytest.mark.parametrize("op", ["varlen_attention", "varlen_attention_vjp"])
def test_can_run_declines_varlen_head_dims_above_256(monkeypatch, op):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    q, v = np.zeros((5, 2, 256)), np.zeros((7, 2, 256))
    assert can_run(_call(op, "cpu", q=q, k=v, v=v)) is True
    verdict = can_run(_call(op, "cpu", q=q, k=v, v=np.zeros((7, 2, 264))))
    assert isinstance(verdict, str) and "Dv=264" in verdict
    verdict = can_run(_call(op, "cpu", q=np.zeros((5, 2, 320)), k=v, v=v))
    assert isinstance(verdict, str) and "D=320" in verdict


def test_float32_and_float64_varlen_calls_on_cuda_go_to_numba_cuda(monkeypatch):
    """Before the reference, which would otherwise serve them on a GPU: float64 first, float32
    after cupy's exact packed kernels where those are installed."""
    from softmaxkit import registry

    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    registry.reload()
    try:
        for op in ("varlen_attention", "varlen_attention_vjp", "paged_attention"):
            for dtype in ("float32", "float64"):
                order, _ = registry.candidates(op, "cuda", dtype)
                first = [n for n in order if n != "cupy"] if dtype == "float32" else order
                assert first[0] == "numba-cuda" and "reference" in order, (op, dtype, order)
            assert "numba-cuda" not in registry.candidates(op, "cuda", "bfloat16")[0]
    finally:
        registry.reload()


@pytest.mark.parametrize(("causal", "window", "lq"), [
    (True, (-1, -1), 1), (False, (-1, -1), 2), (True, (3, -1), 3), (True, (-1, 1), 2),
    (True, (-1, -1), 7),  # more queries than a sequence's keys: rows with no allowed key
])
def test_paged_adapter_gathers_and_masks_as_the_spec_says(monkeypatch, causal, window, lq):
    """The adapter's gathered cache and mask, with the dense attention of the reference in
    place of the kernel (which the kit checks on a GPU), against the float64 definition on
    NaN-poisoned pages: an empty sequence, padding entries -1 and past the pool."""
    import array_api_compat.numpy as xp
    from softmaxkit_numba_cuda import paged

    from softmaxkit.reference.attention import attention as dense
    from softmaxkit.testing.paged_cases import make_cache, paged_definition

    monkeypatch.setattr(paged, "attention", lambda **kw: dense(**kw))
    rng = np.random.default_rng(lq)
    k, v, table, lens = make_cache(rng, [5, 0, 9], 4, 2, 8, 6)
    q = rng.normal(size=(3, 4, lq, 8))
    out, lse = paged.paged_attention(
        xp=xp, q=q, k_pages=k, v_pages=v, block_table=table, seqlens=lens, scale=8 ** -0.5,
        causal="bottom_right" if causal else None, window=window, softcap=None,
        return_lse=True)
    want, want_lse = paged_definition(q, k, v, table, lens, causal=causal, window=window)[:2]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)


def test_can_run_declines_host_arrays_without_the_simulator(monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    verdict = can_run(_call("softmax", "cpu", x=np.zeros((2, 3))))
    assert isinstance(verdict, str) and "CUDA" in verdict
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert can_run(_call("softmax", "cpu", x=np.zeros((2, 3)))) is True


def test_can_run_declines_value_dimensions_beyond_the_vjp_shared_memory(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")

    def verdict(dtype, dv):
        outs = np.zeros((2, 3, dv), dtype=dtype)
        return can_run(_call("merge_attention_vjp", "cpu", outs=outs))

    assert verdict(np.float32, 12288) is True and verdict(np.float64, 6144) is True
    assert isinstance(verdict(np.float32, 12289), str)
    assert "6144" in verdict(np.float64, 6145)


@pytest.mark.parametrize("n", [0, 1, 3, 31, 33, 128, 512, 513, 1024, 4096, 8192, 32768, 131072])
@pytest.mark.parametrize("slots", [1, 2, 4, 16, (2, 4, 8)])
def test_plans_cover_every_row(n, slots):
    short, medium, long = (slots,) * 3 if isinstance(slots, int) else slots
    p = plan.choose(n, slots)
    assert p.threads * p.slots * p.chunks >= max(n, 1)
    assert p.threads & (p.threads - 1) == 0 and p.block <= 1024
    if n <= 32 * short:  # a warp or part of one per row, read once
        assert p.threads <= 32 and p.chunks == 1 and p.slots == short
        assert p.threads == 1 or (p.threads // 2) * short < n  # no more threads than needed
    elif n <= plan.BLOCK * medium:  # a block per row
        assert p.rows_per_block == 1 and p.chunks == 1 and p.slots == medium
        assert p.threads == 64 or (p.threads // 2) * medium < n
    else:  # split across blocks of BLOCK threads, each chunk but the last full
        assert p.threads == plan.BLOCK and p.slots == long
        assert (p.chunks - 1) * p.chunk_words < n
        assert p.grid(10) == 10 * p.chunks if p.split else p.grid(10) == 10


def test_plans_with_smaller_blocks():
    """16-bit rows use blocks of 128 threads for medium rows and for the chunks of long ones."""
    medium = plan.choose(512, (2, 4, 4), block=128)
    assert (medium.threads, medium.slots, medium.chunks) == (128, 4, 1)
    long = plan.choose(4096, (2, 4, 4), block=128)
    assert (long.threads, long.slots, long.chunks, long.rows_per_block) == (128, 4, 8, 1)
    assert long.grid(3) == 24


def test_plan_override():
    p = plan.choose(1000, 4, forced=(64, 2))
    assert (p.threads, p.slots, p.chunks) == (64, 2, 8)
    assert plan.choose(16, 4, forced=(8, 2)).threads == 8  # a short row: groups of 8 threads
    split = plan.choose(1000, 4, forced=(8, 2))  # a split row needs blocks of whole warps
    assert (split.threads, split.rows_per_block, split.chunks) == (32, 1, 16)
    with pytest.raises(ValueError):
        plan.make(48, 2, 10)
    with pytest.raises(ValueError):
        plan.make(16, 2, 100)  # part of a warp cannot hold a chunk of a split row
    assert plan.make(16, 2, 10).rows_per_block == 16
    assert plan.make(32, 1, 100).rows_per_block == 1  # a warp holding one chunk of a row


@pytest.mark.parametrize("n", [1025, 2048, 4095, 4096, 4097, 8192, 16032, 65536, 131072])
def test_staged_plans_fit_shared_memory(n):
    p = plan.staged(n)
    words = p.threads * p.slots
    assert p.rows_per_block == 1 and p.block == p.threads
    assert words * plan.WORD_BYTES <= plan.STAGE_BYTES
    assert p.chunks == -(-n * plan.WORD_BYTES // plan.STAGE_BYTES)  # the fewest chunks
    assert (p.chunks - 1) * words < n <= p.chunks * words  # every chunk holds part of the row
    if n <= plan.STAGE_BYTES // plan.WORD_BYTES:  # one chunk: no exchange between blocks
        assert p.chunks == 1


def test_staged_plan_overrides():
    assert plan.staged(300, forced=(64, 1)) == plan.make(64, 1, 300, group_threads=64)
    assert plan.staged(8192, forced=(256, 16)).chunks == 2
    p = plan.staged(100, simulator=True, forced=(256, 16))
    assert (p.threads, p.chunks, p.rows_per_block) == (256, 1, 1)
    assert plan.staged(300, forced=(16, 1)) == plan.staged(300)  # not whole warps: ignored
    assert plan.staged(200, simulator=True).chunks == 1  # one warp of 8 words each
    assert plan.staged(300, simulator=True).chunks == 2


@pytest.mark.parametrize(("cols", "itemsize", "chunks"), [
    (32768, 4, 2),  # float32 4096x32768: 128 KB rows, a cluster of two 64 KB blocks
    (65536, 4, 4),
    (262144, 2, 8),  # 512 KB: the largest default cluster
    (100000, 4, 7),  # a row that does not divide: 7 equal chunks, the last one short
])
def test_clustered_plans(cols, itemsize, chunks):
    n = cols * itemsize // plan.WORD_BYTES
    p = plan.clustered(n)
    assert p == plan.staged(n)  # the staged chunks, launched as one cluster
    assert p.chunks == chunks and p.threads == plan.STAGE_THREADS
    assert p.chunk_words * plan.WORD_BYTES <= plan.STAGE_BYTES
    assert (p.chunks - 1) * p.chunk_words < n <= p.chunks * p.chunk_words
    assert p.grid(3) == 3 * chunks  # a cluster of `chunks` blocks per row


def test_clustered_plans_decline():
    assert plan.clustered(4096) is None  # 64 KB: one block, nothing to exchange
    bf16_1m = 524288 * 2 // plan.WORD_BYTES  # 16 chunks: through device memory by default
    assert plan.staged(bf16_1m).chunks == 16 and plan.clustered(bf16_1m) is None
    assert plan.clustered(8192, simulator=True) is None  # the simulator: one block only
    assert plan.clustered(8192, mode="0") is None
    # non-portable clusters of up to 16 blocks
    assert plan.clustered(bf16_1m, mode="16").chunks == 16
    assert plan.clustered(bf16_1m * 2, mode="16") is None  # 32 chunks
    assert plan.clustered(8192, mode="2").chunks == 2 and plan.clustered(16384, mode="2") is None
    # clusters of one block, as the simulator runs
    assert plan.clustered(100, simulator=True, mode="all").chunks == 1
    assert plan.clustered(4096, mode="all").chunks == 1
    assert plan.clustered(8192, simulator=True, mode="all") is None


def test_clustered_plan_overrides():
    p = plan.clustered(4096, forced=(256, 8))  # 32 KB chunks
    assert (p.threads, p.slots, p.chunks) == (256, 8, 2)
    assert plan.clustered(32768, forced=(256, 8)) is None  # 16 chunks: more than the default
    assert plan.clustered(131072, forced=(512, 16)) is None
    assert plan.clustered(131072, mode="16", forced=(512, 16)).chunks == 16


def test_persistent_plans():
    bf16_1m = 524288 * 2 // plan.WORD_BYTES  # 16 chunks of 64 KB: one 16-block cluster
    p = plan.persistent(bf16_1m, threads=128)
    assert (p.threads, p.slots, p.chunks) == (128, 32, 16)
    assert plan.row_clusters(p) == 1
    f32_1m = 524288 * 4 // plan.WORD_BYTES  # 32 chunks: two 16-block clusters a row
    p = plan.persistent(f32_1m)
    assert (p.threads, p.slots, p.chunks) == (256, 16, 32) and plan.row_clusters(p) == 2
    assert plan.persistent(8192) is None  # 2 chunks: the one-row cluster kernel
    assert plan.persistent(f32_1m * 2) is None  # 64 chunks: through device memory
    # 17 chunks of 64 KB cannot be halved: 9 chunks of up to 128 KB, one cluster
    assert plan.persistent(4096 * 17).chunks == 9
    p = plan.persistent(f32_1m, mode="wide")  # 128 KB chunks, one cluster a row
    assert (p.threads, p.slots, p.chunks) == (256, 32, 16) and plan.row_clusters(p) == 1
    assert plan.persistent(bf16_1m, mode="0") is None
    assert plan.persistent(bf16_1m, cluster="0") is None  # no clusters at all


def test_row_clusters():
    p = plan.persistent(524288 * 4 // plan.WORD_BYTES)  # 32 chunks of 64 KB
    assert plan.row_clusters(p) == 2
    assert plan.row_clusters(plan.Plan(256, 16, 1, 30)) == 2
    assert plan.row_clusters(plan.Plan(256, 16, 1, 31)) == 0  # odd: no equal halves
    assert plan.row_clusters(plan.Plan(256, 16, 1, 34)) == 0  # halves above 16 chunks
    p = plan.persistent(512, simulator=True, mode="all")  # the simulator: clusters of one
    assert p.chunks == 2 and plan.row_clusters(p, simulator=True) == 2


def test_held_plans():
    f32 = plan.persistent(524288 * 4 // plan.WORD_BYTES)  # 32 chunks of 64 KB
    # 8 words a thread kept: chunks of 256 x 32 words (128 KB), 24 staged: one cluster of 16
    assert plan.held(f32, 131072, 8) == plan.Plan(256, 24, 1, 16)
    assert plan.held(f32, 131072 + 8192, 8) is None  # 17 such chunks: too many
    assert plan.held(f32, 131072 - 16, 8) is None  # not whole chunks
    assert plan.held(f32, 131072, 32) is None and plan.held(f32, 131072, 0) is None


def test_stagger():
    from softmaxkit_numba_cuda import persistent

    wave_ns = 2 * 2**21 * 11 / 4e12 * 1e9  # 11 rows read and written at 4 TB/s
    # 256 = 23 * 11 + 3: the 8 groups that walk 23 rows start one after another, the last a
    # wave late
    assert persistent.stagger(256, 11, 2**21, 4e12) == int(persistent.STAGGER * wave_ns / 8)
    assert persistent.stagger(253, 11, 2**21, 4e12) == 0  # the rows divide evenly
    assert persistent.stagger(5, 11, 2**21, 4e12) == 0  # fewer rows than groups


def test_persistent_plans_in_the_simulator():
    assert plan.persistent(256, simulator=True) is None  # only with "all"
    p = plan.persistent(256, simulator=True, mode="all")  # one chunk: a cluster of one block
    assert p.chunks == 1 and plan.row_clusters(p, simulator=True) == 1
    p = plan.persistent(512, simulator=True, mode="all")  # two chunks: two clusters of one
    assert p.chunks == 2 and plan.row_clusters(p, simulator=True) == 2
    assert plan.persistent(768, simulator=True, mode="all") is None
    assert plan.persistent(4096, mode="all").chunks == 1  # "all" on the GPU: one chunk too


def test_settings_from_environ():
    from softmaxkit_numba_cuda.settings import PREFIX, Settings

    assert Settings.from_environ({}) == Settings()
    s = Settings.from_environ({PREFIX + "PLAN": "64,2", PREFIX + "STAGED": "0",
                               PREFIX + "CLUSTER": "16", PREFIX + "PERSIST": "wide"})
    assert s == Settings(plan=(64, 2), staged=False, cluster="16", persist="wide")
    assert s.replace(plan=None).plan is None and s.plan == (64, 2)  # frozen: a copy
    with pytest.raises(ValueError, match="SOFTMAXKIT_NUMBA_CUDA_PLAN"):
        Settings.from_environ({PREFIX + "PLAN": "64"})
    with pytest.raises(ValueError, match="SOFTMAXKIT_NUMBA_CUDA_CLUSTER"):
        Settings.from_environ({PREFIX + "CLUSTER": "some"})


def test_attention_tiles_shrink_to_the_device_s_shared_memory():
    """On a device that gives a block less shared memory than the H200 (227 KB; 99 KB on
    compute capability 8.6, 8.9 and 12.0) the attention kernels take smaller micro-tiles of
    their tables, so the launch fits; on the H200 they keep their own."""
    from softmaxkit_numba_cuda import attention_kernels as k

    for acc in ("float32", "float64"):
        for d in (32, 64, 96, 128, 160, 192, 256):
            for backward, table, size in ((False, k.FORWARD_TILES, k.forward_shared),
                                          (True, k.BACKWARD_TILES, k.backward_shared)):
                def need(r, c, acc=acc, d=d, size=size):
                    return size(acc, d, d, r, c)

                own = k.tiles(table, acc, d, d)
                assert k.tiles_within(acc, d, d, 227 * 1024, backward) == own
                small = k.tiles_within(acc, d, d, 99 * 1024, backward)
                assert small[0] <= own[0] and small[1] <= own[1]
                assert need(*small) <= 99 * 1024 or small == (1, 1)
                # every tile taken is one of the tables' own (the kernels built and tested)
                assert small in {t for tab in (k.FORWARD_TILES, k.BACKWARD_TILES)
                                 for entries in tab.values() for _, t in entries}
    # float32 at 256: the forward's 64 x 32 tiles (69 KB) instead of 64 x 64 (103 KB)
    assert k.tiles_within("float32", 256, 256, 99 * 1024) == (2, 1)


@pytest.mark.parametrize(("dtype", "d", "backward", "declined"), [
    ("float32", 256, False, False),  # on smaller tiles (tiles_within)
    ("float32", 256, True, False),
    ("float64", 128, True, False),
    ("float64", 256, False, True),  # 104 KB on its smallest tile
    ("float64", 256, True, True),
])
def test_can_run_declines_attention_beyond_the_device_s_shared_memory(
        monkeypatch, dtype, d, backward, declined):
    """On a device whose blocks may take 99 KB (compute capability 8.6, 8.9, 12.0), the calls
    whose smallest tile needs more are declined with the figures; the H200 takes them all."""
    torch = pytest.importorskip("torch")
    from softmaxkit_numba_cuda import arrays

    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    op = "attention_vjp" if backward else "attention"
    q = torch.zeros((1, 1, 2, d), dtype=getattr(torch, dtype))
    for limit, refused in ((99 * 1024, declined), (227 * 1024, False)):
        monkeypatch.setattr(arrays, "shared_limit", lambda a, lib, limit=limit: limit)
        verdict = can_run(_call(op, "cuda", q=q, k=q, v=q))
        assert (verdict is not True) == refused, verdict
        if refused:
            assert f"this device gives {limit}" in verdict and dtype in verdict
