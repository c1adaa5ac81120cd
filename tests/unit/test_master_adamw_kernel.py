"""The one-launch master AdamW kernel, run on CPU by Triton's interpreter (litegen.kernels).

``TRITON_INTERPRET=1`` must be set before the kernel module is imported, so the check runs in
a child process. It steps two dtype groups (one launch each) through tensors of one, two and
a partial block, and compares masters, moments and steps with torch's AdamW in FP32. The
interpreter converts FP32 to bf16 by truncation (NumPy has no bf16), where a GPU rounds to
nearest, so bf16 parameters are checked to within one bf16 step of their master;
tests/gpu/test_master_adamw_gpu.py checks the rounding itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHILD = r"""
import torch
from litegen.kernels import master_adamw

torch.manual_seed(0)
shapes = [(4096,), (4100, 3), (8, 1000), (5,)]  # one block, several, a partial one, a tiny one
dtypes = [torch.float16, torch.bfloat16, torch.float16, torch.bfloat16]
params = [torch.randn(s).to(d) for s, d in zip(shapes, dtypes)]
masters = [p.float() for p in params]
moments = [[torch.zeros_like(m) for m in masters] for _ in range(2)]
steps = [torch.zeros(()) for _ in params]
reference = [m.clone().requires_grad_() for m in masters]
optimizer = torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
launches = []
kernel = master_adamw._adamw_master_kernel
class Counting:
    def __getitem__(self, grid):
        launches.append(grid)
        return kernel[grid]
master_adamw._adamw_master_kernel = Counting()
for _ in range(3):
    grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    master_adamw._step_by_device_and_dtype(
        [params, grads, masters, *moments, steps], 1e-2, (0.9, 0.999), 1e-8, 0.1
    )
    for r, g in zip(reference, grads):
        r.grad = g.float()
    optimizer.step()
assert len(launches) == 3 * 2, launches  # one launch per step and dtype group
assert [s.item() for s in steps] == [3.0] * 4
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
print("ok")
"""


def test_one_launch_per_dtype_group_steps_like_torchs_adamw():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
