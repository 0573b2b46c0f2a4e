"""Tests marked ``gpu`` need a CUDA device that CuPy sees; without one they are skipped.
The fixture ``ptxas`` builds kernel instantiations with nvcc and reads ptxas's report;
``host_kernels`` builds them for the CPU (tests/host/emulation.h) and returns launchers;
``host_snippet`` builds other C++ the same way (e.g. checks of the emulated primitives)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent


@functools.cache
def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if item.path.is_relative_to(HERE) and item.get_closest_marker("gpu") and not _has_gpu():
            item.add_marker(skip)


@dataclasses.dataclass
class PtxasBuild:
    """What :func:`ptxas` built: ptxas's report (``-v``) of every instantiation, the machine
    code files, and the PTX they were assembled from."""

    report: str
    cubins: list[Path]
    ptx: str


@pytest.fixture(autouse=True)
def _no_kept_launches(monkeypatch) -> None:
    """Each test starts with no launches kept (softmaxkit_cupy.kept): one that stands in for
    another device, or runs kernels on the host, must not meet a launch an earlier test kept
    for the same kind of call."""
    from softmaxkit_cupy import kept

    monkeypatch.setattr(kept, "_store", {})


@pytest.fixture
def ptxas(tmp_path: Path) -> Callable[[str, Sequence[str], str], PtxasBuild]:
    """Build instantiations ``names`` of kernel source ``filename`` (local includes inlined,
    the text NVRTC compiles) to machine code for ``gencode`` with ptxas's report, split into
    one translation unit per CPU and compiled side by side (nvcc keeps each unit's PTX);
    fails on a compiler error."""
    nvcc = shutil.which("nvcc") or "/usr/local/bin/nvcc"

    def build(filename: str, names: Sequence[str], gencode: str) -> PtxasBuild:
        from softmaxkit_cupy.compiler import source

        text = source(filename)
        parts = max(1, min(len(names), os.cpu_count() or 1))

        def one(index: int) -> tuple[int, str, Path, Path]:
            unit = tmp_path / f"{filename}.{index}.cu"
            cubin = unit.with_suffix(".cubin")
            keep = tmp_path / f"keep{index}"
            keep.mkdir(exist_ok=True)
            unit.write_text(text + "\n" + "\n".join(
                f"void* sk_instance_{i} = (void*)&{name};"
                for i, name in enumerate(names[index::parts])) + "\n")
            done = subprocess.run([nvcc, "-std=c++17", gencode, "-cubin", "-Xptxas", "-v",
                                   "-keep", "-keep-dir", str(keep), str(unit), "-o", str(cubin)],
                                  capture_output=True, text=True)
            return done.returncode, done.stderr, cubin, keep / unit.with_suffix(".ptx").name

        with ThreadPoolExecutor(max_workers=parts) as pool:
            results = list(pool.map(one, range(parts)))
        failed = [err[-3000:] for rc, err, _, _ in results if rc != 0]
        assert not failed, "\n".join(failed)
        return PtxasBuild("".join(err for _, err, _, _ in results), [r[2] for r in results],
                          "".join(r[3].read_text() for r in results))

    return build


HOST = HERE / "host"
HOST_PRIMITIVES = ("sk_cp_async16", "sk_cp_async_commit", "sk_cp_async_wait", "sk_ex2",
                   "sk_red_add2", "sk_tf32", "sk_mma_tf32", "sk_ldmatrix_x4",
                   "sk_ldmatrix_x4_trans", "sk_wgmma_fence", "sk_wgmma_commit",
                   "sk_wgmma_wait", "sk_fence_proxy_async", "sk_fence_regs", "sk_opaque_tid")
"""Device functions written in PTX that tests/host/primitives.h gives a host meaning (every
overload of each)."""
HOST_SPECIALIZATIONS = ("SkMma<sk_bf16>", "SkMma<__half>", "SkWgmma<32>", "SkWgmma<64>",
                        "SkWgmma<96>", "SkWgmma<128>", "SkWgmma<192>", "SkWgmma<256>")
"""Explicit specializations of class templates whose members are written in PTX (the
16-bit mma.sync of kernels/mma.cuh, the warpgroup products of kernels/wgmma.cuh): taken out
whole, tests/host/primitives.h defines them."""
_CTYPES = {"Q": ctypes.c_void_p, "q": ctypes.c_longlong, "i": ctypes.c_int,
           "I": ctypes.c_uint, "f": ctypes.c_float}
_CNAMES = {"Q": "void*", "q": "long long", "i": "int", "I": "unsigned", "f": "float"}


def host_source(filename: str) -> str:
    """The kernel source (local includes inlined) with the definitions of
    :data:`HOST_PRIMITIVES` it has taken out, for a host build beside tests/host/primitives.h
    (a primitive left in would fail the build: g++ takes no PTX)."""
    from softmaxkit_cupy.compiler import source

    text = source(filename)
    for name in HOST_PRIMITIVES:
        pattern = re.compile(r"(template\s*<[^>]*>\s*)?__device__ __forceinline__ [\w:<>]+ "
                             + name + r"\s*\(")
        while (found := pattern.search(text)) is not None:  # none: not used by this source
            end = _closing_brace(text, text.index("{", found.end()))
            text = text[:found.start()] + text[end + 1:]
    for name in HOST_SPECIALIZATIONS:
        found = re.search(r"template\s*<>\s*struct\s+" + re.escape(name) + r"\s*\{", text)
        if found is not None:
            end = _closing_brace(text, found.end() - 1)
            semicolon = re.compile(r"\s*;").match(text, end + 1)
            assert semicolon is not None, name
            text = text[:found.start()] + text[semicolon.end():]
    return text


def _gxx() -> str:
    """The path of g++; skips the test where it is not installed."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    return gxx


def _closing_brace(text: str, start: int) -> int:
    """The index of the brace that closes the one at ``start``."""
    depth, end = 0, start
    while True:
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return end
        end += 1


def _host_library(gxx: str, unit: Path, text: str) -> ctypes.CDLL:
    """``text`` written to ``unit`` and built with g++ into a shared library beside it, with
    tests/host/emulation.h and primitives.h included first; loaded.  Fails on a compiler
    error.  Strict aliasing is off: the kernels pun types through ``reinterpret_cast`` as
    CUDA C++ lets them (two 16-bit values stored as one word, a ``uint4`` read as eight)."""
    unit.write_text(text)
    library = unit.with_suffix(".so")
    done = subprocess.run(
        [gxx, "-std=c++20", "-O2", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread",
         "-w", f"-I{HOST}", "-include", "emulation.h", "-include", "primitives.h", str(unit),
         "-o", str(library)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-5000:]
    return ctypes.CDLL(str(library))


@pytest.fixture(scope="session")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    """``build(filename, names, codes)``: kernels ``names`` of kernels/``filename`` (their
    parameters as the launch codes ``codes`` of :mod:`softmaxkit_cupy.launches` say: one
    string for all, or a mapping of each name to its own) built for the CPU with g++, split
    into one library per CPU compiled side by side; returns ``{name: launch}``, where
    ``launch(grid, threads, shared, *args)`` runs the kernel over the grid, its pointer
    arguments given as addresses.  A kernel already built with the same parameters in this
    session is not built again (the mask's packing kernel, which
    :func:`host_attention.move_to_host` asks for in every test with a mask, builds once).
    Skips without g++."""
    gxx = _gxx()
    folder = tmp_path_factory.mktemp("host")
    builds = itertools.count()
    launchers: dict[tuple[str, str, str], Callable[..., None]] = {}

    def build(filename: str, names: Sequence[str],
              codes: str | Mapping[str, str]) -> dict[str, Any]:
        code_of = {name: codes if isinstance(codes, str) else codes[name] for name in names}
        missing = [name for name in dict.fromkeys(names)
                   if (filename, name, code_of[name]) not in launchers]
        parts = max(1, min(len(missing), os.cpu_count() or 1))
        stem = f"{filename}.{next(builds)}"

        def one(index: int) -> dict[str, Any]:
            chunk = missing[index::parts]
            wrappers = "\n".join(_host_wrapper(i, name, code_of[name])
                                  for i, name in enumerate(chunk))
            loaded = _host_library(gxx, folder / f"{stem}.{index}.cpp",
                                   host_source(filename) + "\n" + wrappers + "\n")
            return {name: _host_launcher(getattr(loaded, f"sk_host_{i}"), code_of[name])
                    for i, name in enumerate(chunk)}

        if missing:
            with ThreadPoolExecutor(max_workers=parts) as pool:
                for launches in pool.map(one, range(parts)):
                    launchers.update({(filename, name, code_of[name]): launch
                                      for name, launch in launches.items()})
        return {name: launchers[filename, name, code_of[name]] for name in names}

    return build


def _host_wrapper(i: int, name: str, codes: str) -> str:
    """The C entry point ``sk_host_{i}`` that launches kernel ``name`` (parameters ``codes``)
    on the host: the grid, the threads a block, the shared bytes, then its arguments."""
    params = ", ".join(f"{_CNAMES[c]} a{j}" for j, c in enumerate(codes))
    call = ", ".join(f"sk_host_ptr{{a{j}}}" if c == "Q" else f"a{j}"
                     for j, c in enumerate(codes))
    return (f'extern "C" void sk_host_{i}(unsigned gx, unsigned gy, unsigned gz, '
            f"unsigned threads, unsigned long long shared, {params}) {{ "
            f"sk_host_launch({{gx, gy, gz}}, threads, shared, [&] {{ {name}({call}); }}); }}")


def _host_launcher(function: Any, codes: str) -> Callable[..., None]:
    """``launch(grid, threads, shared, *args)`` of a :func:`_host_wrapper` entry point."""
    function.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_ulonglong] + [_CTYPES[c] for c in codes]
    function.restype = None

    def launch(grid: tuple[int, int, int], threads: int, shared: int, *args: Any) -> None:
        function(*grid, threads, shared, *args)

    return launch


@pytest.fixture(scope="session")
def host_snippet(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], ctypes.CDLL]:
    """``build(text)``: C++ source ``text`` (CUDA C++ as the kernels write it, its entry points
    ``extern "C"`` functions that call ``sk_host_launch``) built for the CPU with g++ as
    :func:`host_kernels` builds kernels, beside tests/host/emulation.h and primitives.h;
    returns the loaded library.  Skips without g++."""
    gxx = _gxx()
    folder = tmp_path_factory.mktemp("snippet")

    def build(text: str) -> ctypes.CDLL:
        return _host_library(gxx, folder / f"snippet{len(list(folder.iterdir()))}.cpp", text)

    return build
