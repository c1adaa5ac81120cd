"""FP32 master weights on CUDA: the one-pass Triton AdamW against torch's (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from litegen.experimental import Lab, available
from litegen.optim import enable_master_weights
from litegen.utils.config import ExperimentalConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
STEPS = 6
SHAPES = ((4100, 96), (4100,), (8, 4100))  # 4100: not a multiple of the kernel's block


def gradients(step: int) -> list[torch.Tensor]:
    """New gradients each step, the same for both paths; a quarter of them far below eps."""
    generator = torch.Generator(device="cuda").manual_seed(step)
    grads = []
    for shape in SHAPES:
        grad = torch.randn(shape, device="cuda", generator=generator) * 1e-2
        tiny = torch.rand(shape, device="cuda", generator=generator) < 0.25
        grads.append(torch.where(tiny, grad * 1e-7, grad).to(torch.bfloat16))
    return grads


def train(fused: bool, steps: int = STEPS) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """bf16 parameters stepped through masters; fused=True takes the Triton path.

    The gradients do not depend on the parameters, so the two paths cannot drift apart through
    a bf16 forward pass: what differs is the update arithmetic alone.
    """
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in SHAPES]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused)
    enable_master_weights(optimizer)
    # What prepare does with optimization.experimental.master_adamw: the lab attaches the kernel.
    Lab(ExperimentalConfig(master_adamw=True)).configure_optimizer(optimizer)
    for step in range(steps):
        for p, grad in zip(params, gradients(step), strict=True):
            p.grad = grad
        optimizer.step()
    return params, optimizer


class _Counting:
    """Wraps a Triton kernel so the test sees its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def test_one_pass_master_adamw_matches_torchs_adamw_on_the_masters(monkeypatch):
    if not available("master_adamw"):
        pytest.skip(f"master_adamw is not tested on torch {torch.__version__}")
    from litegen.experimental import master_adamw

    calls = []
    monkeypatch.setattr(
        master_adamw, "_adamw_master_kernel", _Counting(master_adamw._adamw_master_kernel, calls)
    )
    params, optimizer = train(fused=True)
    assert len(calls) == STEPS  # one launch a step steps every parameter
    ref_params, ref_optimizer = train(fused=False)
    initial = [p.float() for p in train(fused=True, steps=0)[0]]
    for p, ref, start in zip(params, ref_params, initial, strict=True):
        state, ref_state = optimizer.state[p], ref_optimizer.state[ref]
        assert state["step"].item() == ref_state["step"].item() == STEPS
        # The update itself (about lr * STEPS), not the weights, compared tightly: bias
        # corrections, eps and weight decay all show in it.
        update, ref_update = state["master"] - start, ref_state["master"] - start
        assert ref_update.abs().max() > 1e-2
        torch.testing.assert_close(update, ref_update, rtol=1e-4, atol=1e-6)  # ~2 ulps at 4
        for key in ("exp_avg", "exp_avg_sq"):
            # Absolute to the moment's scale: where a moment cancels to near zero, the two
            # paths' different fp32 roundings (mul-add against torch's lerp) are all that is left.
            scale = ref_state[key].abs().max().item()
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-6 * scale)
        assert torch.equal(p, state["master"].to(torch.bfloat16))  # the parameter is its rounding


def test_a_saved_and_loaded_state_continues_like_an_uninterrupted_run():
    params, optimizer = train(fused=True, steps=3)
    saved = optimizer.state_dict()
    resumed_params, resumed = train(fused=True, steps=0)
    resumed.load_state_dict(saved)
    with torch.no_grad():
        for p, q in zip(resumed_params, params, strict=True):
            p.copy_(q)
    for state in resumed.state.values():
        assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
    straight_params, straight = train(fused=True, steps=4)
    for p, grad in zip(resumed_params, gradients(3), strict=True):
        p.grad = grad
    resumed.step()
    for p, q in zip(resumed_params, straight_params, strict=True):
        assert torch.equal(resumed.state[p]["master"], straight.state[q]["master"])


def test_misaligned_tensors_step_like_aligned_ones_and_strided_ones_are_left_to_torch():
    from litegen.experimental import master_adamw

    flat = torch.zeros(4100, device="cuda")
    aligned, misaligned = flat[:4096], flat[1:4097]  # 4 bytes past a 16-byte boundary
    step = torch.zeros((), device="cuda")
    lists = ([aligned.bfloat16()], [aligned.bfloat16()], [aligned], [aligned], [aligned], [step])
    assert master_adamw.servable(*lists)
    assert master_adamw.servable(*lists[:2], [misaligned], *lists[3:])  # a launch of its own
    strided = torch.zeros(8192, device="cuda")[::2]
    assert not master_adamw.servable(*lists[:2], [strided], *lists[3:])
    grad = torch.randn(4096, device="cuda").bfloat16()
    results = []
    for master in (torch.empty(4096, device="cuda"), misaligned):
        master.copy_(torch.linspace(-1, 1, 4096, device="cuda"))
        param, moments = master.bfloat16(), [torch.zeros(4096, device="cuda") for _ in range(2)]
        master_adamw.adamw_master_step(
            [param], [grad], [master], *([m] for m in moments), [torch.zeros((), device="cuda")],
            lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
        )  # fmt: skip
        results.append((param, master.clone()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
