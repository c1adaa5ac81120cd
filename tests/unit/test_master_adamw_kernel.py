"""The one-launch master AdamW kernel, run on CPU by Triton's interpreter (litegen.kernels).

``TRITON_INTERPRET=1`` must be set before the kernel module is imported, so the checks run in
a child process:

* against torch's AdamW in FP32: three dtype and alignment groups (one launch each per step)
  through tensors of one, several, a partial and no block, and ``beta1 = 0``;
* against float64 arithmetic at step 1 to 3 with constant gradients, where the update is
  ``lr * g / (|g| + eps)`` whatever the bias corrections, if they are exact: an FP32
  ``1 - beta2 ** step`` would be off by 6e-6 (beta2 0.999) to 6e-5 (0.9999).

The interpreter converts FP32 to bf16 by truncation (NumPy has no bf16), where a GPU rounds to
nearest, so bf16 parameters are checked to within one bf16 step of their master;
tests/gpu/test_master_adamw_gpu.py checks the rounding itself.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

CHILD = r"""
import torch
from litegen.experimental import master_adamw

launches = []
kernel = master_adamw._adamw_master_kernel
class Counting:
    def __getitem__(self, grid):
        launches.append(grid)
        return kernel[grid]
master_adamw._adamw_master_kernel = Counting()


def off_boundary(t):
    # The same values 4 bytes past a 16-byte boundary, as in a DDP gradient bucket.
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    return flat.copy_(t)


def against_torch(betas, steps=3):
    torch.manual_seed(0)
    shapes = [(4096,), (4100, 3), (8, 1000), (5,), (0,), (300,)]
    dtypes = [torch.float16, torch.bfloat16, torch.float16, torch.bfloat16, torch.float16, torch.bfloat16]
    params = [torch.randn(s).to(d) for s, d in zip(shapes, dtypes)]
    masters = [p.float() for p in params]
    masters[-1] = off_boundary(masters[-1])  # the last one is a group of its own
    moments = [[torch.zeros_like(m) for m in masters] for _ in range(2)]
    counters = [torch.zeros(()) for _ in params]
    reference = [m.clone().requires_grad_() for m in masters]
    optimizer = torch.optim.AdamW(reference, lr=1e-2, betas=betas, weight_decay=0.1)
    launches.clear()
    for _ in range(steps):
        grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
        master_adamw._step_by_device_and_dtype(
            [params, grads, masters, *moments, counters], 1e-2, betas, 1e-8, 0.1
        )
        for r, g in zip(reference, grads):
            r.grad = g.float()
        optimizer.step()
    assert len(launches) == 3 * steps, launches  # fp16, bf16 and the misaligned bf16 group
    assert [c.item() for c in counters] == [steps] * len(params)
    for i, r in enumerate(reference):
        state = optimizer.state[r]
        torch.testing.assert_close(masters[i], r.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(moments[0][i], state["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(moments[1][i], state["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        if params[i].dtype == torch.float16:
            assert torch.equal(params[i], masters[i].half())
        else:
            step = masters[i].abs() * 2.0**-7  # one bf16 step at the master's scale
            assert ((params[i].float() - masters[i]).abs() <= step).all()


def exact_bias_corrections(betas, steps):
    g = (torch.rand(1000, generator=torch.Generator().manual_seed(1)) * 2 - 1).bfloat16()
    columns = [[torch.zeros(1000).bfloat16()], [g]] + [[torch.zeros(1000)] for _ in range(3)]
    columns.append([torch.zeros(())])
    for _ in range(steps):
        master_adamw._step_by_device_and_dtype(columns, 1e-2, betas, 1e-8, 0.0)
    expected = -steps * 1e-2 * g.double() / (g.double().abs() + 1e-8)
    error = ((columns[2][0].double() - expected).abs() / expected.abs()).max().item()
    assert error < 1e-6, (betas, steps, error)


against_torch((0.9, 0.999))
against_torch((0.0, 0.99))  # beta1 = 0: no first-moment bias correction
for betas in ((0.9, 0.999), (0.95, 0.9999), (0.0, 0.99)):
    for steps in (1, 3):
        exact_bias_corrections(betas, steps)
print("ok")
"""


def test_the_kernel_steps_like_torchs_adamw_with_exact_bias_corrections(triton_interpreter):
    assert triton_interpreter("-c", CHILD).strip().endswith("ok")
