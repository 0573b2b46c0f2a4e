"""Draw the task graph of ``softmaxkit.softmax`` on a Dask array into docs/scaling_graph.png.

The picture is made from the real graph (not a sketch): one row of boxes per layer of tasks,
an arrow for every dependency.  Run with ``python docs/scaling_graph.py``.
"""

from __future__ import annotations

import os
from collections import defaultdict

import dask.array as da
import matplotlib
import numpy as np
from dask.core import get_dependencies

import softmaxkit as sk

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LAYERS = [  # key prefix -> label, top to bottom
    ("input", "input chunks (read)"),
    ("softmaxkit-summary-state", "per-chunk summary (max, mass): read 1"),
    ("softmaxkit-merge", "merge tree (rescale to the larger max)"),
    ("softmaxkit-softmax-block", "normalize each chunk: read 2"),
]


def _layer(key) -> int | None:
    name = key[0] if isinstance(key, tuple) else key
    if name == "input":
        return 0
    if name.startswith("softmaxkit-summary-state"):
        return 1
    if name.startswith("softmaxkit-merge"):
        return 2
    if name.startswith("softmaxkit-softmax-block"):
        return 3
    return None


def main(chunks: int = 16, path: str | None = None) -> str:
    """Build softmax over one row of ``chunks`` chunks and draw its graph; returns the path."""
    x = da.from_array(np.zeros((1, chunks * 4)), chunks=(1, 4), name="input")
    graph = dict(sk.softmax(x, axis=-1).__dask_graph__())
    deps = {k: get_dependencies(graph, k) for k in graph}
    # the merge layer holds the tree's levels: place each task by its depth in the tree
    depth: dict = {}

    def level(key) -> int:
        if key not in depth:
            parents = [d for d in deps[key] if _layer(d) == 2]
            depth[key] = 0 if not parents else 1 + max(level(d) for d in parents)
        return depth[key]

    rows: dict[tuple[int, int], list] = defaultdict(list)
    for key in graph:
        layer = _layer(key)
        if layer is None:
            continue
        rows[(layer, level(key) if layer == 2 else 0)].append(key)
    ys = sorted(rows)
    pos = {}
    for rank, y in enumerate(ys):
        keys = sorted(rows[y], key=lambda k: k[1:] if isinstance(k, tuple) else ())
        for i, key in enumerate(keys):
            pos[key] = ((i + 0.5) / len(keys), -rank)
    fig, ax = plt.subplots(figsize=(10, 6.5))
    for key, (px, py) in pos.items():
        for dep in deps[key]:
            if dep in pos:
                qx, qy = pos[dep]
                ax.annotate("", xy=(px, py + 0.12), xytext=(qx, qy - 0.12),
                            arrowprops={"arrowstyle": "->", "color": "0.6", "lw": 0.6})
    colors = ["#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc"]
    for key, (px, py) in pos.items():
        ax.plot(px, py, "s", ms=9, color=colors[_layer(key)], mec="0.3", mew=0.6)
    for layer, label in enumerate(label for _, label in LAYERS):
        first = min(py for key, (px, py) in pos.items() if _layer(key) == layer)
        top = max(py for key, (px, py) in pos.items() if _layer(key) == layer)
        ax.text(-0.02, (first + top) / 2, label, ha="right", va="center", fontsize=9)
    ax.set_xlim(-0.62, 1.02)
    ax.set_ylim(-len(ys) + 0.5, 0.5)
    ax.axis("off")
    ax.set_title(f"softmax of one row in {chunks} chunks: {len(graph)} tasks, "
                 "each chunk read by two tasks, no task holds more than one chunk",
                 fontsize=10)
    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaling_graph.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


if __name__ == "__main__":
    print(main())
