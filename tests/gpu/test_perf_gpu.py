"""Compile, attention backends and FLOP counting on CUDA (skipped without a GPU)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from litegen.compile import compile_blocks
from litegen.experimental.row_reductions import persistent_rows_context
from litegen.flops.throughput import FlopCounter, peak_flops
from litegen.kernels.attention import BACKENDS, attention_context
from litegen.memory import apply_memory_optimizations
from litegen.utils.config import CompileConfig, MemoryConfig
from litegen_zoo.dit_model import DiT, DiTConfig, sample_batch
from scripts.lab.gpu_power import PowerMeter, sustained

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SMALL = DiTConfig(hidden=128, depth=3, heads=2, num_classes=10)  # head dim 64


def loss_and_grads(model, tokens=64):
    x, t = sample_batch(model.cfg, 2, tokens, "cuda")
    with torch.autocast("cuda", torch.bfloat16):
        loss = (model(x, t).float() - x).square().mean()
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("policy", [None, "block", "ops", "ops_all", "memory_budget"])
def test_inductor_blocks_match_eager(policy):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = DiT(SMALL).cuda()
    compiled = DiT(SMALL).cuda()
    compiled.load_state_dict(eager.state_dict())
    budget = None
    if policy:
        checkpoint = {"enabled": True, "selective_ratio": 0.0, "policy": policy}
        memory = MemoryConfig.model_validate({"activation_checkpoint": checkpoint})
        budget = apply_memory_optimizations(compiled, memory).memory_budget
    cfg = CompileConfig(enabled=True, dynamic=None)
    assert len(compile_blocks(compiled, cfg, memory_budget=budget)) == 3
    ref_loss, ref_grads = loss_and_grads(eager)
    loss, grads = loss_and_grads(compiled)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-3)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=5e-2, atol=5e-3, msg=name)


@pytest.mark.parametrize("name", ["auto", *BACKENDS])
def test_every_backend_matches_math(name):
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 256, 72, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    )
    with attention_context("math", "cuda"):
        ref = F.scaled_dot_product_attention(q, k, v)
    try:
        with attention_context(name, "cuda"):
            out = F.scaled_dot_product_attention(q, k, v)
    except RuntimeError as exc:  # e.g. cuDNN attention absent from this build or GPU
        pytest.skip(f"{name} unavailable here: {str(exc).splitlines()[0]}")
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_peak_is_known_for_datacenter_gpus_and_the_counter_runs():
    name = torch.cuda.get_device_name()
    if any(key in name for key in ("H100", "H200", "A100", "H800")):
        assert peak_flops("cuda") is not None
    layer = torch.nn.Linear(64, 64, device="cuda")
    with FlopCounter() as counter:
        layer(torch.randn(8, 64, device="cuda")).sum().backward()
    assert counter.flops == 2 * (2 * 8 * 64 * 64)  # forward and dW (the input needs no grad)


class NormBlock(torch.nn.Module):
    """A LayerNorm and a scale, as a DiT block starts; 1152 wide, DiT-XL's hidden size."""

    def __init__(self, hidden: int = 1152) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.scale = torch.nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x):
        return x + self.norm(x) * (1 + self.scale)


def compile_norms(limit):
    """Two compiled NormBlocks: bf16 output, forward kernels' code, a gradient, training code."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(NormBlock(), NormBlock()).cuda()
    context = [persistent_rows_context(limit)] if limit is not None else []
    compile_blocks(model, CompileConfig(enabled=True), paths=["0", "1"], block_contexts=context)
    x = torch.randn(4, 256, 1152, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        output, kernels = run_and_get_code(model, x)
    # The training graphs, forward and backward, compile in this call (compile.py).
    _, training = run_and_get_code(lambda: model(x.float()).square().mean().backward())
    return output, "\n".join(kernels), model[0].scale.grad, "\n".join(training)


def test_persistent_rows_compiles_row_norms_in_one_pass():
    from litegen.experimental.row_reductions import ROWS_PER_PROGRAM, row_launch_config

    # In this order, so that a compile cache shared between the settings would show.
    looped, looped_code, looped_grad, looped_training = compile_norms(None)
    one_pass, one_pass_code, one_pass_grad, one_pass_training = compile_norms(2048)
    _, again_code, _, again_training = compile_norms(None)
    backward_norm = r"def triton_(red|per)_fused\w*native_layer_norm_backward\w*\("
    for code, training in ((looped_code, looped_training), (again_code, again_training)):
        assert "triton_red_fused" in code and "triton_per_fused" not in code
        assert {m.group(1) for m in re.finditer(backward_norm, training)} == {"red"}
    # Forward: one pass with a fixed launch config (row_reductions.row_launch_config);
    # inductor names such kernels "unk", not "per".
    launch = row_launch_config(1152, ROWS_PER_PROGRAM)  # two warps
    assert "triton_red_fused" not in one_pass_code
    assert "fixed_config(" in one_pass_code and repr(launch)[1:-1] in one_pass_code
    # Backward: the input gradient's row reduction in one pass, autotuned.
    assert {m.group(1) for m in re.finditer(backward_norm, one_pass_training)} == {"per"}
    torch.testing.assert_close(one_pass, looped, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(one_pass_grad, looped_grad, rtol=1e-4, atol=1e-4)


class GatedNormBlock(torch.nn.Module):
    """A LayerNorm of the input times a gate per token: its kernel loads a value per row."""

    def __init__(self, hidden: int = 1152) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)

    def forward(self, x, gate):
        return self.norm(x * gate)


def test_persistent_rows_compile_norms_that_load_a_value_per_row():
    # The fixed launch config on a kernel that loads a value per row: with one row a program,
    # torch 2.11's code generation fails on it (row_reductions.ROWS_PER_PROGRAM).
    torch._dynamo.reset()
    block = GatedNormBlock().cuda()
    context = [persistent_rows_context(2048)]
    compile_blocks(block, CompileConfig(enabled=True), paths=[""], block_contexts=context)
    x = torch.randn(4, 256, 1152, device="cuda", requires_grad=True)
    gate = torch.rand(4, 256, 1, device="cuda", requires_grad=True)
    block(x, gate).square().mean().backward()
    eager = GatedNormBlock().cuda()
    x2, gate2 = x.detach().requires_grad_(), gate.detach().requires_grad_()
    eager(x2, gate2).square().mean().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gate.grad, gate2.grad, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_the_power_meter_reads_a_gemm_loop_at_a_plausible_power():
    meter = PowerMeter.for_device(torch.device("cuda"))
    if meter is None:
        pytest.skip("NVML reads no energy on this GPU")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    reading = sustained(lambda: a @ a, meter, seconds=0.5, settle_s=0.1)
    assert 0 < reading["ms"] < 100 and reading["mj"] > 0
    # Above an idle GPU's few tens of watts, within any GPU's limit; clocks of a working GPU.
    assert 50 < reading["watts"] < 2000 and 100 < reading["sm_mhz"] < 4000
    assert 0.0 <= reading["power_capped"] <= 1.0
