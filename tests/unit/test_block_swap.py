"""Block swap on a CPU 'device': the same losses and gradients as without it, with the frozen
weights of the swapped blocks back in host memory between steps and every fetch counted."""

from __future__ import annotations

import pytest
import torch

from litegen.config import LoRAConfig, MemoryConfig
from litegen.lora import apply_lora
from litegen.memory import BlockSwap, apply_memory_optimizations
from tests.distributed.models import PairDataset, loss_fn, make_model

CPU = torch.device("cpu")
STEPS = 3


def lora_model() -> torch.nn.Module:
    model = make_model()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=["mlp.0", "mlp.2", "ada"]))
    return model


def train(
    blocks_on_device: int | None, checkpoint_ratio: float | None = None, policy: str = "block"
) -> dict:
    model = lora_model()
    swap = None
    if blocks_on_device is not None:
        swap = BlockSwap(model, blocks_on_device, CPU)
    if checkpoint_ratio is not None:
        memory = MemoryConfig(
            activation_checkpoint={
                "enabled": True,
                "selective_ratio": checkpoint_ratio,
                "policy": policy,
            }
        )
        apply_memory_optimizations(model, memory, device=CPU)
    if swap is not None:
        swap.to_host()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    batches = torch.utils.data.DataLoader(PairDataset(8 * STEPS), batch_size=8)
    losses, grads = [], []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "swap": swap, "model": model}


def frozen_bytes(block: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in block.parameters() if not p.requires_grad)


# ops and ops_all recompute under selective checkpointing, which matches the ops of a block's
# recompute to its forward's one by one: the swap's copies must not be among them.
@pytest.mark.parametrize(
    "checkpoint_ratio, policy",
    [(None, "block"), (0.0, "block"), (0.34, "block"), (0.0, "ops"), (0.34, "ops_all")],
)
def test_block_swap_trains_as_on_the_device(checkpoint_ratio, policy):
    reference = train(None, checkpoint_ratio, policy)
    swapped = train(1, checkpoint_ratio, policy)
    assert swapped["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    for got, want in zip(swapped["grads"], reference["grads"], strict=True):
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=name)
    swap, model = swapped["swap"], swapped["model"]
    assert swap.swapped == ["blocks.1", "blocks.2"]
    # Each step fetches both swapped blocks for the forward and again for the backward
    # (their saved weights, or their recompute).
    per_step = sum(frozen_bytes(model.get_submodule(p)) for p in swap.swapped)
    assert swap.stats.fetches >= 4 * STEPS
    assert swap.stats.bytes_streamed >= 2 * per_step * STEPS
    assert swap.stats.prefetched >= 2 * STEPS
    # Between steps the swapped blocks hold their host copies; the adapters were never moved.
    for i, path in enumerate(swap.paths):
        frozen = [p for p in model.get_submodule(path).parameters() if not p.requires_grad]
        hosts = swap._host.get(i, [])
        assert [p.data_ptr() for p in frozen if i >= 1] == [t.data_ptr() for t in hosts]


def test_block_swap_with_all_blocks_on_device_moves_nothing():
    swapped = train(3)
    assert swapped["swap"].swapped == [] and swapped["swap"].stats.fetches == 0


def test_the_docs_block_swap_config_loads():
    import yaml

    from litegen.config import MainConfig
    from tests.unit.test_doc_snippets import blocks

    text = blocks("memory.md", "## Block swap (`block_swap`)", "yaml")[0]
    config = MainConfig.from_dict(yaml.safe_load(text))
    assert config.optimization.memory.block_swap.blocks_on_device == 10
