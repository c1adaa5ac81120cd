"""LoRA on 2 gloo ranks: only the adapters train, every strategy matches DDP, with and without
the fused kernels of the recommended fine-tuning settings (``fused_wan_attention``,
``fused_gelu_mlp``: torch's ops on the CPU), the adapter files (model and EMA) load into a fresh
diffusers model through diffusers' own loader, and a run resumed from its run checkpoint equals
an uninterrupted one."""

import pytest
import torch

# Imported in the parent so the forked ranks inherit them (peft imports transformers).
from diffusers.loaders import WanLoraLoaderMixin

from litegen.lora import apply_lora
from tests.distributed.harness import run_ranks
from tests.distributed.models import WAN_TARGETS, WanDataset, make_wan, wan_loss

pytestmark = pytest.mark.slow

STEPS = 4
LORA = {"rank": 4, "alpha": 8, "target_modules": WAN_TARGETS}


# The recommended settings' kernels, switched on for this torch (they run on the tested one).
FUSED = {"fused_wan_attention": True, "fused_gelu_mlp": True}


def train_lora(strategy: str, folder: str, fused: bool = False) -> dict:
    import torch.distributed as dist

    import litegen
    from litegen import experimental
    from litegen.utils.config import MainConfig

    optimization = {"parallel": {"strategy": strategy}, "lora": LORA}
    if fused:
        for name in FUSED:
            experimental.TESTED_TORCH[name] = (experimental.torch_release(),)
        optimization["experimental"] = FUSED
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": folder,
            "exp_name": "wan",
            "global_batch_size": 4,
            "max_steps": STEPS,
            "ema": {"enable": True, "decay": 0.5},
            "optimization": optimization,
        }
    )
    gen = litegen.initialize(config)
    model = make_wan()
    base = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = gen.prepare(model, optimizer, WanDataset())
    losses = []
    for batch in loader:
        loss = wan_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        gen.update_ema()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    unwrapped = gen.unwrap(model)
    adapters = sum(p.numel() for p in unwrapped.parameters() if p.requires_grad)
    return {
        "fused": fused_modules(unwrapped),
        "losses": torch.tensor(losses),
        "base": base,
        "state": gen.full_model_state(model),
        "ema": gen.full_ema_state(),
        "ema_bytes": gen.ema.local_bytes(),
        "adapter_numel": adapters,
        "file": str(gen.save_model()),
        "ema_file": str(gen.save_ema()),
    }


def fused_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many self-attention layers and MLPs of ``model`` run the fused kernels."""
    from litegen.experimental.fused_gelu_mlp import is_fused
    from litegen.experimental.wan_attention import FusedWanSelfAttention

    modules = list(model.modules())
    return {
        "attention": sum(
            isinstance(getattr(m, "processor", None), FusedWanSelfAttention) for m in modules
        ),
        "mlp": sum(is_fused(m) for m in modules),
    }


@torch.no_grad()
def outputs(model: torch.nn.Module) -> torch.Tensor:
    inputs, _ = WanDataset(4, seed=1)[:]
    return model.eval()(*inputs, return_dict=False)[0]


def from_state(state: dict) -> torch.Tensor:
    """Outputs of a fresh model adapted like the trained one and given its gathered state."""
    model = apply_lora(make_wan(), _section())
    model.load_state_dict(state)
    return outputs(model)


def from_file(path: str) -> torch.Tensor:
    """Outputs of a fresh model given an adapter file through diffusers' pipeline loader."""
    model = make_wan()
    state, metadata = WanLoraLoaderMixin.lora_state_dict(path, return_lora_metadata=True)
    WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=model, metadata=metadata)
    return outputs(model)


def _section():
    from litegen.config import LoRAConfig

    return LoRAConfig(**LORA)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return run_ranks(train_lora, 2, "ddp", str(tmp_path_factory.mktemp("ddp")))[0]


def test_only_the_adapters_train_and_their_files_load_in_diffusers(ddp):
    state, base = ddp["state"], ddp["base"]
    adapters = {k for k in state if ".lora_" in k}
    frozen = {k.replace(".base_layer.", "."): k for k in state if k not in adapters}
    assert adapters and set(frozen) == set(base)
    for original, name in frozen.items():
        assert torch.equal(state[name], base[original]), f"frozen {name} changed"
    assert all(state[k].abs().sum() > 0 for k in adapters if ".lora_B." in k)  # B starts at 0
    # The EMA holds the adapters alone: a full FP32 replica of them is the most a rank keeps.
    assert ddp["ema_bytes"] <= 4 * ddp["adapter_numel"]
    torch.testing.assert_close(from_file(ddp["file"]), from_state(state), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        from_file(ddp["ema_file"]), from_state(ddp["ema"]), rtol=0, atol=1e-6
    )
    assert not torch.allclose(from_file(ddp["file"]), from_file(ddp["ema_file"]))


@pytest.mark.parametrize("strategy", ["fsdp2", "zero2", "fsdp1"])
def test_lora_under_sharding_strategies_equals_ddp(strategy, ddp, tmp_path):
    got = run_ranks(train_lora, 2, strategy, str(tmp_path))[0]
    torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-5, atol=1e-6)
    assert set(got["state"]) == set(ddp["state"])
    for name, value in got["state"].items():
        torch.testing.assert_close(value, ddp["state"][name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(from_file(got["file"]), from_file(ddp["file"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2", "fsdp1"])
def test_lora_with_the_fused_kernels_equals_ddp_without_them(strategy, ddp, tmp_path):
    got = run_ranks(train_lora, 2, strategy, str(tmp_path), True)[0]
    assert got["fused"] == {"attention": 2, "mlp": 2} and ddp["fused"] == {"attention": 0, "mlp": 0}
    torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-5, atol=1e-6)
    # Compared by what the weights compute: the cross-attention's query and key adapters of this
    # tiny model barely move its outputs, so Adam's normalised steps turn the rounding of their
    # gradients into weights that differ, with outputs equal to 1e-6.
    torch.testing.assert_close(
        from_state(got["state"]), from_state(ddp["state"]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(from_file(got["file"]), from_file(ddp["file"]), atol=1e-5, rtol=0)


def train_loop(folder: str, steps: int, **trainer) -> dict:
    """LoRA under fsdp2 through the real training loop, with run checkpoints in ``folder``."""
    import litegen
    from litegen.trainer import Trainer
    from litegen.utils.config import MainConfig

    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "results_dir": folder,
            "global_batch_size": 4,
            "max_steps": steps,
            "ema": {"enable": True, "decay": 0.5},
            "optimization": {"parallel": {"strategy": "fsdp2"}, "lora": LORA},
            "trainer": {"log_every": 1, "save_final": False, **trainer},
        }
    )
    gen = litegen.initialize(config)
    model = make_wan()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = gen.prepare(model, optimizer, WanDataset())
    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    losses = Trainer(gen, lambda batch, model: wan_loss(model, batch), parts).fit()
    return {"losses": losses, "state": gen.full_model_state(model), "ema": gen.full_ema_state()}


def stop_and_resume(folder: str) -> dict:
    straight = train_loop(f"{folder}/a", STEPS)
    first = train_loop(f"{folder}/b", STEPS // 2, checkpoint_every=STEPS // 2)
    resumed = train_loop(f"{folder}/b", STEPS, resume_run=f"{folder}/b")
    return {"straight": straight, "first": first, "resumed": resumed}


def test_a_lora_run_resumes_from_its_run_checkpoint_exactly(tmp_path):
    result = run_ranks(stop_and_resume, 2, str(tmp_path))[0]
    straight, first, resumed = result["straight"], result["first"], result["resumed"]
    assert first["losses"] + resumed["losses"] == straight["losses"]
    for key in ("state", "ema"):
        for name, value in straight[key].items():
            assert torch.equal(value, resumed[key][name]), (key, name)
    # The run checkpoint holds what trains; the frozen base comes from the model on every start.
    from torch.distributed.checkpoint import FileSystemReader

    (model_dir,) = {p.parent for p in (tmp_path / "b").glob("**/model_0/.metadata")}
    saved = FileSystemReader(str(model_dir)).read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("model.")]
    assert weights and all("lora_" in key for key in weights), weights
