"""FA4 on the packed qkv tensor (litegen.kernels.packed_qkv), on CPU with a stand-in for FA4.

Dynamo captures a block's attention as on a GPU; the pass rewrites the graph, and AOTAutograd
runs it eagerly (``aot_eager``: inductor's own pre-grad passes need its code generation). FA4 is
the FP32 stand-in of test_fa4.py, so the tests check:

* the rewrite of a DiT's ``view + permute`` split, of timm's ``unbind`` + ``transpose`` split
  and of ``select`` + ``transpose``, also inside activation checkpointing: one packed op
  instead of SDPA, with the output and every gradient of the block matching FP32 math
  attention;
* the packed op's backward returns one gradient laid out like the packed tensor, which is the
  point: autograd then has nothing to copy;
* calls the flash backend would not serve, or whose q, k, v are not one tensor's three slices,
  keep their SDPA;
* compiled blocks run with the pass installed when ``pack_qkv`` asks for it.

tests/gpu/test_fa4_gpu.py compiles a block with inductor and the real kernels.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from litegen.compile import compile_blocks, uncompile_blocks
from litegen.kernels import fa4, packed_qkv
from litegen.kernels.packed_qkv import PACKED_ATTENTION, PackQkvAttention
from litegen.utils.config import CompileConfig
from tests.unit.test_fa4 import StandInFA4

HEADS, HEAD_DIM, TOKENS = 2, 16, 12
HIDDEN = HEADS * HEAD_DIM


class Attention(nn.Module):
    """A DiT's attention; ``split`` picks how it makes q, k and v from its projection."""

    def __init__(self, split: str = "permute", **sdpa_kwargs) -> None:
        super().__init__()
        self.split, self.sdpa_kwargs = split, sdpa_kwargs
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        packed = self.qkv(x).view(b, n, 3, HEADS, c // HEADS)
        if self.split in ("permute", "checkpointed"):  # the reference DiT's
            q, k, v = packed.permute(2, 0, 3, 1, 4)
        elif self.split == "unbind":  # timm's older attention
            q, k, v = (t.transpose(1, 2) for t in packed.unbind(2))
        elif self.split == "select":
            q, k, v = (packed.select(2, i).transpose(1, 2) for i in range(3))
        elif self.split == "swapped":  # k and q exchanged: not FA4's (q, k, v) order
            k, q, v = packed.permute(2, 0, 3, 1, 4)
        else:  # "copies": contiguous q, k, v are no longer slices of one tensor
            q, k, v = (t.contiguous() for t in packed.permute(2, 0, 3, 1, 4))
        out = F.scaled_dot_product_attention(q, k, v, **self.sdpa_kwargs)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def compile_with_pass(module: nn.Module, pack: PackQkvAttention, graphs: list) -> nn.Module:
    """``module.forward`` compiled with the pass applied to Dynamo's graph, then run eagerly."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for graph_module in gm.modules():  # as inductor, into checkpointing's subgraphs too
            if isinstance(graph_module, torch.fx.GraphModule):
                pack(graph_module.graph)
                graph_module.recompile()
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    module.forward = torch.compile(module.forward, backend=backend, dynamic=False)
    return module


def targets(gm: torch.fx.GraphModule) -> set:
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return {node.target for graph in graphs for node in graph.nodes if node.op == "call_function"}


@pytest.fixture
def stand_in():
    torch._dynamo.reset()
    with mock.patch.object(fa4, "interface", return_value=StandInFA4()):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("split", ["permute", "unbind", "select", "checkpointed"])
def test_packed_attention_replaces_sdpa_and_matches_math_attention(stand_in, split):
    torch.manual_seed(0)
    reference = Attention(split)
    x = torch.randn(2, TOKENS, HIDDEN)
    grad = torch.randn(2, TOKENS, HIDDEN)
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(grad)

    module = Attention(split).to(torch.bfloat16)
    module.load_state_dict(reference.state_dict())
    if split == "checkpointed":  # as LiteGen's activation checkpointing wraps a block
        forward = module.forward
        module.forward = lambda x: checkpoint(forward, x, use_reentrant=False)
    pack, graphs = PackQkvAttention(device_types=("cpu",)), []
    compile_with_pass(module, pack, graphs)
    x_bf16 = x.to(torch.bfloat16).requires_grad_()
    out = module(x_bf16)
    out.backward(grad.to(torch.bfloat16))

    assert pack.rewritten == 1
    assert PACKED_ATTENTION in targets(graphs[0])
    assert F.scaled_dot_product_attention not in targets(graphs[0])
    tolerance = {"rtol": 2e-2, "atol": 2e-2}  # bf16 against FP32
    torch.testing.assert_close(out.float(), reference(x), **tolerance)
    torch.testing.assert_close(x_bf16.grad.float(), x_ref.grad, **tolerance)
    for name, param in module.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(param.grad.float(), expected, **tolerance)


def test_packed_backward_writes_one_gradient_laid_out_like_the_projection(stand_in):
    torch.manual_seed(1)
    projection = torch.randn(2, TOKENS, 3, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    packed = projection.permute(2, 0, 3, 1, 4)  # (3, batch, heads, tokens, dim) view
    out, logsumexp = PACKED_ATTENTION(packed, False, None)
    grad_out = torch.randn_like(out)
    grad = packed_qkv.packed_attention_backward(grad_out, packed, out, logsumexp, False, None)

    assert grad.stride() == packed.stride()  # its permute back is the projection's layout
    assert grad.permute(1, 3, 0, 2, 4).is_contiguous()
    math = packed.float().detach().requires_grad_()
    expected_out = F.scaled_dot_product_attention(*math.unbind(0))
    expected_out.backward(grad_out.float())
    torch.testing.assert_close(out.float(), expected_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad.float(), math.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("split", "sdpa_kwargs", "dtype"),
    [
        ("permute", {"attn_mask": torch.ones(TOKENS, TOKENS, dtype=torch.bool)}, torch.bfloat16),
        ("permute", {"dropout_p": 0.1}, torch.bfloat16),
        ("swapped", {}, torch.bfloat16),
        ("copies", {}, torch.bfloat16),
        ("permute", {}, torch.float32),  # the flash backend is fp16/bf16 only
    ],
)
def test_calls_flash_would_not_serve_keep_their_sdpa(stand_in, split, sdpa_kwargs, dtype):
    module = Attention(split, **sdpa_kwargs).to(dtype)
    pack, graphs = PackQkvAttention(device_types=("cpu",)), []
    compile_with_pass(module, pack, graphs)
    module(torch.randn(2, TOKENS, HIDDEN, dtype=dtype))
    assert pack.rewritten == 0
    assert F.scaled_dot_product_attention in targets(graphs[0])


def test_only_the_passes_device_types_are_rewritten(stand_in):
    pack, graphs = PackQkvAttention(), []  # CUDA only, FA4's device
    compile_with_pass(Attention().to(torch.bfloat16), pack, graphs)(
        torch.randn(2, TOKENS, HIDDEN, dtype=torch.bfloat16)
    )
    assert pack.rewritten == 0
    assert pack.uuid() != PackQkvAttention(device_types=("cpu",)).uuid()


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("pack_qkv", [True, False])
def test_compiled_blocks_run_with_the_pass_installed_when_asked(pack_qkv):
    seen = []

    def backend(gm, example_inputs):  # runs inside the compiled block's first call
        seen.append(torch._inductor.config.pre_grad_custom_pass)
        return gm

    torch._dynamo.reset()
    model = Blocks()
    compile_blocks(model, CompileConfig(enabled=True), backend=backend, pack_qkv=pack_qkv)
    model(torch.randn(2, TOKENS, HIDDEN))
    expected = packed_qkv.PACK_QKV if pack_qkv else None
    assert seen and all(installed is expected for installed in seen)
    assert torch._inductor.config.pre_grad_custom_pass is None  # only around the call
    uncompile_blocks(model)
    torch._dynamo.reset()
