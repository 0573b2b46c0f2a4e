"""Train a small causal transformer language model with softmaxkit, next to plain PyTorch.

Two copies of one model (same seed, same initial weights, same batches) train side by side:
one uses ``softmaxkit.attention`` (grouped-query, causal) and the fused
``softmaxkit.cross_entropy``, the other ``torch.nn.functional.scaled_dot_product_attention``
and ``torch.nn.functional.cross_entropy``.  The loss curves are printed next to each other;
on a GPU each run's training throughput (tokens/s) is measured too.

The data are synthetic: sequences drawn from a fixed random sparse first-order Markov chain,
so the loss has a known floor (the chain's entropy rate) that both models approach.

Examples
--------
CPU, float32, a few seconds::

    python examples/train_lm.py --steps 200

GPU, bfloat16 autocast, with throughput::

    python examples/train_lm.py --device cuda --dtype bfloat16 --steps 300 --dim 512 \\
        --heads 8 --kv-heads 2 --seq 1024 --batch 16 --vocab 32000
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import softmaxkit as sk

SUCCESSORS = 8
"""Possible next tokens of each token in the synthetic data."""


class Attention(nn.Module):
    """Causal grouped-query self-attention; ``impl`` picks softmaxkit or torch's SDPA."""

    def __init__(self, dim: int, heads: int, kv_heads: int, impl: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.impl = heads, kv_heads, dim // heads, impl
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.impl == "softmaxkit":
            a = sk.attention(q, k, v, causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(a.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, impl: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, impl)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int,
                 seq: int, impl: str) -> None:
        super().__init__()
        self.impl = impl
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, impl) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def set_impl(self, impl: str) -> None:
        self.impl = impl
        for block in self.blocks:
            block.attn.impl = impl

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).flatten(0, 1)
        if self.impl == "softmaxkit":
            return sk.cross_entropy(logits, targets.flatten())
        return F.cross_entropy(logits, targets.flatten())


def markov_batches(steps: int, batch: int, seq: int, vocab: int, seed: int,
                   device: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """Batches from a fixed random sparse Markov chain, and the chain's entropy rate (nats).

    Each token has ``SUCCESSORS`` possible next tokens with random probabilities, so the
    data have structure to learn at any vocabulary size; every batch is drawn up front.
    """
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g)
    probs = torch.softmax(torch.randn(vocab, SUCCESSORS, generator=g, dtype=torch.float64) * 2,
                          dim=-1)
    stationary = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    for _ in range(100):  # power iteration to the stationary distribution
        stationary = torch.zeros_like(stationary).index_add_(
            0, succ.flatten(), (stationary[:, None] * probs).flatten())
    entropy = float(-(stationary[:, None] * probs * probs.log()).sum())
    # drawn on the training device, time-major: one gather per position for every sequence
    cdf, succ = probs.cumsum(-1).float().to(device), succ.to(device)
    seqs = torch.empty(seq + 1, steps * batch, dtype=torch.long, device=device)
    seqs[0] = torch.randint(0, vocab, (steps * batch,), generator=g).to(device)
    uniform = torch.rand(seq, steps * batch, 1, generator=g).to(device)
    for t in range(seq):  # inverse-CDF sampling of every sequence's next token at once
        pick = (uniform[t] > cdf[seqs[t]]).sum(-1).clamp_max(SUCCESSORS - 1)
        seqs[t + 1] = succ[seqs[t], pick]
    seqs = seqs.T.reshape(steps, batch, seq + 1)
    return [(s[:, :-1], s[:, 1:]) for s in seqs], entropy


def train(model: nn.Module, batches: Sequence, lr: float, device: str, dtype: torch.dtype,
          warmup: int) -> tuple[list[float], float]:
    """Train on ``batches``; the losses, and tokens/s over the steps after ``warmup``."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    autocast = (torch.autocast(device_type=device.split(":")[0], dtype=dtype)
                if dtype != torch.float32 else contextlib.nullcontext())
    losses = []
    start = None
    for step, (tokens, targets) in enumerate(batches):
        if step == warmup:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
        with autocast:
            loss = model(tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    timed = len(batches) - warmup
    elapsed = time.perf_counter() - start if start is not None else math.nan
    tokens = timed * batches[0][0].numel()
    return [float(v) for v in losses], tokens / elapsed if timed > 0 else math.nan


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=25, help="print every N steps")
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from tokens/s")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(a.seed)
    reference = LanguageModel(a.vocab, a.dim, a.layers, a.heads, a.kv_heads, a.seq, "torch")
    reference.to(a.device)
    ours = copy.deepcopy(reference)
    ours.set_impl("softmaxkit")
    batches, entropy = markov_batches(a.steps, a.batch, a.seq, a.vocab, a.seed + 1, a.device)
    warmup = min(a.warmup, max(a.steps - 1, 0))
    results = {}
    for name, model in (("softmaxkit", ours), ("torch", reference)):
        run = torch.compile(model, fullgraph=True) if a.compile else model
        results[name] = train(run, batches, a.lr, a.device, dtype, warmup)
    curve_sk, tps_sk = results["softmaxkit"]
    curve_torch, tps_torch = results["torch"]
    if not a.quiet:
        print(f"# {a.layers} layers, dim {a.dim}, {a.heads} query / {a.kv_heads} key-value "
              f"heads, seq {a.seq}, batch {a.batch}, vocab {a.vocab}, {a.dtype} on {a.device}; "
              f"entropy rate of the data {entropy:.4f} nats")
        print(f"{'step':>6} {'softmaxkit':>12} {'torch':>12} {'|diff|':>10}")
        for i in range(0, a.steps, a.every):
            print(f"{i:>6} {curve_sk[i]:>12.5f} {curve_torch[i]:>12.5f} "
                  f"{abs(curve_sk[i] - curve_torch[i]):>10.2e}")
        last = a.steps - 1
        print(f"{last:>6} {curve_sk[last]:>12.5f} {curve_torch[last]:>12.5f} "
              f"{abs(curve_sk[last] - curve_torch[last]):>10.2e}")
        print(f"max |diff| over the curve: "
              f"{max(abs(x - y) for x, y in zip(curve_sk, curve_torch, strict=True)):.3e}")
        if a.device.startswith("cuda"):
            print(f"tokens/s: softmaxkit {tps_sk:,.0f}  torch {tps_torch:,.0f}  "
                  f"ratio {tps_sk / tps_torch:.3f}x")
    return {"softmaxkit": curve_sk, "torch": curve_torch, "entropy": entropy,
            "tokens_per_s": {"softmaxkit": tps_sk, "torch": tps_torch}}


if __name__ == "__main__":
    main()
