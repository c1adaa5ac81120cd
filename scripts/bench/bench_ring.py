"""Ring attention's cost against unsplit attention at equal length, on one GPU.

One GPU cannot run a ring of several ranks, so this measures what a rank computes: at
``cp`` ranks, a rank attends its ``S/cp`` queries to ``cp`` chunks of ``S/cp`` keys, one fused
kernel call per chunk (LiteGen's block kernels, :class:`litegen.parallel.sequence.ring.Kernel`),
merged by log-sum-exp, and runs the matching ``cp`` backward calls. ``cp`` such ranks do the
work of one unsplit attention over ``S`` tokens; the table gives

- ``unsplit ms``: ``F.scaled_dot_product_attention`` forward + backward over ``S`` tokens;
- ``rank ms``: one rank's forward + backward at ``cp`` (no communication: the chunks are local);
- ``overhead``: ``cp x rank ms / unsplit ms`` (1.00 = splitting costs nothing; the
  communication, which overlaps the next chunk's kernel on a real ring, is not in it);
- ``ring(1) ms``: :func:`litegen.parallel.sequence.ring.ring_attention` over a group of one
  rank (torch's templated ring, the block op and the autograd function, one chunk) against the
  unsplit attention, its machinery's cost at ``cp = 1``.

It first checks, at a small size, that the chunked forward and gradients, and those of
``ring_attention`` over one rank (torch's private ring on this torch), equal SDPA's.

    PYTHONPATH=litegen_core/src:litegen_cli/src:. python3 -m scripts.bench.bench_ring
    PYTHONPATH=litegen_core/src:litegen_cli/src:. python3 -m scripts.bench.bench_ring \
        --tokens 32760,75600 --cp 2,4,8 --out ring.json
    uv run --locked python -m scripts.bench.bench_ring --device cpu --tokens 512 --heads 2  # dry run

Defaults: Wan 2.1 1.3B's self-attention (12 heads of 128), bf16, 32,760 and 75,600 tokens
(81 frames at 480p and 720p).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from litegen.parallel.sequence import torch_ring
from litegen.parallel.sequence.ring import Kernel, RingSpec, ring_attention


def one_rank(kernel, q, ks, vs, grad_out=None):
    """One rank's queries ``q`` against every chunk, merged in fp32 as torch's ring merges;
    with ``grad_out``, each block's backward. Returns the output and the block gradients."""
    out = lse = None
    saved = []
    for k, v in zip(ks, vs, strict=True):
        block_out, block_lse, s = kernel.forward(q, k, v, None, None)
        saved.append(s)
        block_out, block_lse = block_out.float(), block_lse.float()
        if out is None:
            out, lse = block_out, block_lse
        else:
            out, lse = torch_ring.merge(out, lse, block_out, block_lse)
    out = out.to(q.dtype)
    grads = []
    if grad_out is not None:
        for k, v, s in zip(ks, vs, saved, strict=True):
            grads.append(kernel.backward(grad_out, q, k, v, out, lse, None, None, s))
    return out, grads


def chunked(q, k, v, cp: int, grad_out: torch.Tensor):
    """A ring of ``cp`` computed rank after rank on this device: the output, and the
    gradients of q, k and v summed over the ranks' blocks."""
    kernel = Kernel(q, masked=False)
    qs, ks, vs, douts = (t.chunk(cp, dim=2) for t in (q, k, v, grad_out))
    outs, grad_q = [], []
    grad_k = [torch.zeros_like(c, dtype=torch.float32) for c in ks]
    grad_v = [torch.zeros_like(c, dtype=torch.float32) for c in vs]
    for rank in range(cp):
        out, grads = one_rank(kernel, qs[rank], ks, vs, douts[rank].contiguous())
        outs.append(out)
        grad_q.append(sum(g[0].float() for g in grads))
        for j, (_, gk, gv) in enumerate(grads):
            grad_k[j] += gk.float()
            grad_v[j] += gv.float()
    cat = lambda parts: torch.cat(parts, dim=2)  # noqa: E731
    return cat(outs), [cat(grad_q), cat(grad_k), cat(grad_v)]


def rank_step(q, k, v, cp: int, grad_out: torch.Tensor) -> None:
    """Rank 0's forward and backward at ``cp`` (what every rank of the ring computes)."""
    kernel = Kernel(q, masked=False)
    dout = grad_out.chunk(cp, dim=2)[0].contiguous()
    one_rank(kernel, q.chunk(cp, dim=2)[0], k.chunk(cp, dim=2), v.chunk(cp, dim=2), dout)


def unsplit_step(q, k, v, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves).backward(grad_out)


def ring1_step(q, k, v, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, RingSpec(dist.group.WORLD, lengths=(q.shape[2],)))
    out.backward(grad_out)


def timed(fn, repeats: int, device: str) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def check_exact(dtype: torch.dtype, device: str) -> float:
    """Largest error of the chunked forward and gradients against SDPA's, relative to their
    magnitude, at 4 chunks of 256 tokens."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, 12, 1024, 128, device=device, dtype=dtype, generator=gen) for _ in range(4)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves)
    expected.backward(dout)
    out, grads = chunked(q, k, v, 4, dout)
    pairs = [(out, expected), *zip(grads, [t.grad for t in leaves], strict=True)]
    # torch's templated ring (this torch's private API) through LiteGen's autograd function.
    ring_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ring = ring_attention(*ring_leaves, RingSpec(dist.group.WORLD, lengths=(q.shape[2],)))
    ring.backward(dout)
    pairs += [
        (ring, expected),
        *((r.grad, t.grad) for r, t in zip(ring_leaves, leaves, strict=True)),
    ]
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs
    )


def measure(tokens: int, cps: list[int], args, device: str, dtype: torch.dtype) -> list[dict]:
    """The rows of one sequence length: unsplit, and one rank at each ring size."""
    shape = (1, args.heads, tokens, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))
    unsplit = timed(lambda: unsplit_step(q, k, v, dout), args.repeats, device)
    ring1 = timed(lambda: ring1_step(q, k, v, dout), args.repeats, device)
    rows = []
    for cp in cps:
        rank = timed(lambda cp=cp: rank_step(q, k, v, cp, dout), args.repeats, device)
        rows.append(
            {
                "tokens": tokens,
                "cp": cp,
                "unsplit_ms": unsplit,
                "rank_ms": rank,
                "overhead": cp * rank / unsplit,
                "ring1_ms": ring1,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="32760,75600")
    parser.add_argument("--cp", default="2,4,8")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: dry run")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_ring needs a CUDA GPU (or --device cpu for a dry run)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    print(f"torch {torch.__version__}, {name}")
    for check in (torch.bfloat16, torch.float32) if device == "cuda" else (torch.float32,):
        error = check_exact(check, device)
        print(f"chunked vs SDPA, 4 chunks, {check}: max relative error {error:.2e}")

    header = ("tokens", "cp", "unsplit ms", "rank ms", "overhead", "ring(1) ms")
    print(" ".join(f"{h:>11}" for h in header))
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for row in measure(tokens, [int(c) for c in args.cp.split(",")], args, device, dtype):
            rows.append(row)
            print(
                " ".join(
                    f"{v:>11,.2f}" if isinstance(v, float) else f"{v:>11,}" for v in row.values()
                )
            )
    if args.out is not None:
        record = {"device": name, "torch": torch.__version__, "rows": rows}
        args.out.write_text(json.dumps(record, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
