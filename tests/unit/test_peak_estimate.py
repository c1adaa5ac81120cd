"""The peak estimate against real tensors: a tiny diffusers Wan built on the meta device gives
the weight, gradient and optimizer bytes of the same model after one real CPU training step
through ``prepare``, and the activation bytes a real CPU forward saves; the CLI prints it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import litegen
from litegen.memory.peak_estimate import estimate_peak
from litegen.memory.saved_bytes import AttentionAsFlash, count_saved_bytes
from litegen.runtime.steps import apply_estimate_steps
from litegen.utils.config import MainConfig
from litegen_cli.app import app

pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from litegen_zoo.real_models import REAL_MODELS  # noqa: E402

WAN = REAL_MODELS["wan"]
LAYERS = 4  # tiny Wan with four blocks, so block swap keeps some and streams the others
LORA = {"rank": 4, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
ENTRY = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "real_model_entry.py"
SETTINGS = {
    "full": {},
    "bf16-mixed": {"precision": {"preset": "bf16-mixed"}},
    "lora": {"lora": LORA},
    "lora fp8_base": {"lora": {**LORA, "fp8_base": "rowwise"}},
    "lora block_swap": {"lora": LORA, "memory": {"block_swap": {"blocks_on_device": 1}}},
}


def nbytes(tensors) -> int:
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def real_step(tmp_path: Path, optimization: dict) -> dict[str, int]:
    """One training step through ``prepare`` on the CPU; the bytes of what it holds after."""
    config = {"runtime": {"device": "cpu"}, "results_dir": str(tmp_path), "exp_name": "exp"}
    gen = litegen.initialize(MainConfig.from_dict({**config, "optimization": optimization}))
    model = WAN.build("tiny", num_layers=LAYERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = gen.prepare(model, optimizer)
    WAN.loss(model, WAN.batch("tiny", batch_size=2)).backward()
    optimizer.step()
    inner = gen.unwrap(model)
    weights = nbytes([*inner.parameters(), *inner.buffers()])
    swap = gen.models[0].memory.block_swap
    if swap is not None:  # the swapped blocks' frozen weights are host copies; two fetches fly
        host = [p for path in swap.swapped for p in inner.get_submodule(path).parameters()]
        weights -= nbytes(p for p in host if not p.requires_grad)
        weights += min(2, len(swap.swapped)) * swap.stats.bytes_streamed // swap.stats.fetches
    state = [
        t
        for per_param in optimizer.state.values()
        for key, t in per_param.items()
        if key != "step" and isinstance(t, torch.Tensor)
    ]
    grads = [p.grad for p in inner.parameters() if p.grad is not None]
    return {"weights": weights, "gradients": nbytes(grads), "optimizer": nbytes(state)}


def meta_estimate(optimization: dict):
    config = MainConfig.from_dict({"runtime": {"device": "cpu"}, "optimization": optimization})
    with torch.device("meta"):
        model = WAN.build("tiny", num_layers=LAYERS)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    apply_estimate_steps(model, optimizer, config.optimization)
    batch = {k: v.to("meta") for k, v in WAN.batch("tiny", batch_size=2).items()}
    return estimate_peak(model, config.optimization, lambda: WAN.loss(model, batch))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_weights_gradients_and_optimizer_are_those_of_a_real_step(tmp_path, name):
    real = real_step(tmp_path, SETTINGS[name])
    estimate = meta_estimate(SETTINGS[name])
    assert real["weights"] > 0 and real["gradients"] > 0 and real["optimizer"] > 0
    got = {k: getattr(estimate, k) for k in real}
    assert got == real
    assert estimate.peak == sum(got.values()) + estimate.activations


def test_settings_shrink_what_they_should():
    full, lora = meta_estimate(SETTINGS["full"]), meta_estimate(SETTINGS["lora"])
    fp8, swap = meta_estimate(SETTINGS["lora fp8_base"]), meta_estimate(SETTINGS["lora block_swap"])
    assert lora.gradients < full.gradients / 5 and lora.optimizer < full.optimizer / 5
    assert fp8.weights < lora.weights and swap.weights < lora.weights
    checkpointed = meta_estimate(
        {"memory": {"activation_checkpoint": {"enabled": True, "selective_ratio": 0.0}}}
    )
    assert checkpointed.checkpointed == LAYERS
    assert checkpointed.activations < full.activations


def saved_per_block(model: torch.nn.Module, batch: dict) -> dict[str, int]:
    """What each block saves on a real CPU forward, counted independently of saved_bytes: by
    storage address, leaving out parameters, buffers and each block's inputs and outputs.
    Attention runs under AttentionAsFlash, so it saves what a flash kernel saves (the CPU's
    math kernel would save the attention matrix too, which no GPU kernel keeps)."""
    paths = [f"blocks.{i}" for i in range(LAYERS)]
    kept = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    running, saved, held = [None], {p: {} for p in paths}, []
    boundary = {p: set() for p in paths}

    def ptrs(values) -> set[int]:  # of tensors in nested tuples (Wan's rotary embedding)
        if isinstance(values, torch.Tensor):
            return {values.untyped_storage().data_ptr()}
        return (
            set().union(*(ptrs(v) for v in values)) if isinstance(values, tuple | list) else set()
        )

    def pack(t):
        held.append(t)
        if running[0] is not None and t.untyped_storage().data_ptr() not in kept:
            saved[running[0]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for path in paths:
        block = model.get_submodule(path)

        def pre(_m, args, kwargs, path=path):
            running[0] = path
            boundary[path] |= ptrs([*args, *kwargs.values()])

        def post(_m, _a, _k, out, path=path):
            running[0] = None
            boundary[path] |= ptrs(out if isinstance(out, tuple) else [out])

        block.register_forward_pre_hook(pre, with_kwargs=True)
        block.register_forward_hook(post, with_kwargs=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), AttentionAsFlash():
        WAN.loss(model, batch)
    return {p: sum(n for ptr, n in saved[p].items() if ptr not in boundary[p]) for p in paths}


def test_activation_bytes_of_unchecked_blocks_are_what_a_real_forward_saves():
    batch = WAN.batch("tiny", batch_size=2)
    real = saved_per_block(WAN.build("tiny", num_layers=LAYERS), batch)
    with torch.device("meta"):
        model = WAN.build("tiny", num_layers=LAYERS)
    meta_batch = {k: v.to("meta") for k, v in batch.items()}
    counted = count_saved_bytes(
        model, [f"blocks.{i}" for i in range(LAYERS)], lambda: WAN.loss(model, meta_batch)
    )
    assert all(n > 0 for n in real.values())
    # Exact: the same ops save the same tensors on the meta device as on the CPU.
    assert {p: s.activation_bytes for p, s in counted.blocks.items()} == real


def write_recipe(tmp_path: Path, entry: Path, **extra) -> Path:
    data = {
        "launch": {"entry": str(entry)},
        "results_dir": str(tmp_path / "results"),
        "runtime": {"device": "cpu"},
        "global_batch_size": 2,
        "model": {"name": "wan", "size": "tiny"},
        **extra,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def test_inspect_config_estimate_prints_the_table(tmp_path):
    recipe = write_recipe(tmp_path, ENTRY, optimization={"lora": LORA})
    result = invoke("inspect-config", recipe, "--estimate", "--device-gib", "1")
    assert result.exit_code == 0, result.output
    for part in ("weights", "gradients", "optimizer", "activations", "peak", "fits"):
        assert part in result.output
    assert "does not fit" not in result.output and "tight" not in result.output


def test_inspect_config_without_estimate_stays_off_torch_work(tmp_path):
    result = invoke("inspect-config", write_recipe(tmp_path, ENTRY))
    assert result.exit_code == 0, result.output
    assert "activations" not in result.output


def test_an_entry_that_cannot_build_on_meta_exits_2_with_one_message(tmp_path):
    entry = tmp_path / "entry.py"
    entry.write_text(  # reads a weight's value at build time, which the meta device has not
        "import torch\n\n\n"
        "def build(config):\n"
        "    model = torch.nn.Linear(2, 2)\n"
        "    print(model.weight.norm().item())\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    data = torch.utils.data.TensorDataset(torch.randn(4, 2))\n"
        "    return {'model': model, 'optimizer': optimizer, 'data': data}\n\n\n"
        "def train_step(batch, model):\n"
        "    return model(batch[0]).sum()\n"
    )
    result = invoke("inspect-config", write_recipe(tmp_path, entry), "--estimate")
    assert result.exit_code == 2
    assert "cannot estimate the peak" in result.output
    assert "Traceback" not in result.output


def test_the_finetune_recipe_estimates_from_its_pipelines_config(tmp_path):
    """litegen.finetune on meta: the transformer from its config.json, the cached samples."""
    pytest.importorskip("av")
    from tests.media import make_media_folder
    from tests.pipelines import tiny_pipeline_folder

    media = make_media_folder(tmp_path / "media", images=2, videos=1, frames=9)
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "finetune_video.yaml"
    args = [
        recipe,
        f"finetune.pipeline={tiny_pipeline_folder('wan')}",
        f"finetune.data.folder={media}",
        f"finetune.data.cache_root={tmp_path / 'cache'}",
        f"results_dir={tmp_path / 'results'}",
        "runtime.device=cpu",
        "launch.nproc_per_node=1",
        "global_batch_size=1",
        "finetune.data.resolution=32",
    ]
    before = invoke("inspect-config", *args, "--estimate")
    assert before.exit_code == 2 and "litegen cache build" in before.output
    # A data problem, not the entry's: no advice on meta devices, and no cache folder made.
    assert "meta device when runtime.device" not in before.output.replace("\n", " ")
    assert not (tmp_path / "cache").exists()
    assert invoke("cache", "build", *args).exit_code == 0
    result = invoke("inspect-config", *args, "--estimate")
    assert result.exit_code == 0, result.output
    assert "activations" in result.output and "0 of 2 checkpointed" in result.output
