"""FP32 master weights on CUDA: the one-pass Triton AdamW against torch's (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from litegen.optim import enable_master_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def train(fused: bool, steps: int = 3) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """bf16 parameters stepped through masters with fixed gradients; fused=True: the Triton path.

    The gradients do not depend on the parameters, so the two paths cannot drift apart through
    a bf16 forward pass: what differs is the update arithmetic alone.
    """
    torch.manual_seed(0)
    shapes = ((4100, 96), (4100,), (8, 4100))  # 4100: not a multiple of the kernel's block
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in shapes]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused)
    enable_master_weights(optimizer)
    for _ in range(steps):
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        optimizer.step()
    return params, optimizer


def test_one_pass_master_adamw_matches_torchs_adamw_on_the_masters(monkeypatch):
    from litegen.kernels import master_adamw

    calls = []
    monkeypatch.setattr(
        master_adamw, "_adamw_master_kernel", _Counting(master_adamw._adamw_master_kernel, calls)
    )
    params, optimizer = train(fused=True)
    assert len(calls) == 3 * len(params)  # the kernel ran, once per parameter and step
    ref_params, ref_optimizer = train(fused=False)
    initial = train(fused=True, steps=0)[0]
    for p, ref, start in zip(params, ref_params, initial, strict=True):
        state, ref_state = optimizer.state[p], ref_optimizer.state[ref]
        for key in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-6)
        assert state["step"].item() == ref_state["step"].item() == 3
        assert torch.equal(p, state["master"].to(torch.bfloat16))  # the parameter is its rounding
        assert not torch.equal(p, start)  # and it was trained


class _Counting:
    """Wraps a Triton kernel so the test sees its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]
