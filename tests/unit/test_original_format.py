"""The original-format key maps checked by converters someone else wrote: LoRA files loaded by
diffusers' own loaders (``lora_state_dict`` + ``load_lora_into_transformer``, what
``pipe.load_lora_weights`` runs) and full weights read by ``from_single_file`` give the trained
transformer's outputs; and our own inverse converters give back what went in.

Flux's ``single_blocks.N.linear1`` is read by diffusers 0.42 at Flux.1's widths only (it splits
the fused rows at 3072/12288), and its ``from_single_file`` likewise: those two tests build one
block of each kind at Flux.1's width (``slow``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from litegen.config.sections import LoRAConfig
from litegen.families import key_map_for
from litegen.families.flux import ORIGINAL_KEYS as FLUX_KEY_MAP
from litegen.families.wan import ORIGINAL_KEYS as WAN_KEY_MAP
from litegen.finetune.export import write_original_lora
from litegen.lora import adapter_alpha_state, apply_lora
from litegen.model_keys.original_format import (
    lora_from_original,
    lora_to_original,
    output_rows,
    weights_from_original,
    weights_to_original,
)
from litegen.pretrained import load_component
from tests.pipelines import tiny_pipeline_folder

pytest.importorskip("peft")

WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
# Outside the blocks, where the file carries the scale in lora_B instead of an alpha.
WAN_OUTER_TARGETS = ["proj_out", "time_proj", "text_embedder.linear_1"]
# Wan I2V adds the image keys and values of cross-attention and the image embedder's MLP.
WAN_I2V_TARGETS = [*WAN_TARGETS, "add_k_proj", "add_v_proj", "image_embedder.ff.net.0.proj"]
# Every Linear of the double blocks (fused q/k/v of both streams) and the single blocks'
# linear2 and modulation; their linear1 needs Flux.1's width (test_flux_linear1_...).
FLUX_TARGETS = (
    r"^(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|"
    r"to_out\.0|to_add_out)|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2)|"
    r"norm1\.linear|norm1_context\.linear)|single_transformer_blocks\.\d+\.(proj_out|norm\.linear))$"
)


# -- models ----------------------------------------------------------------------------------
def tiny_wan(image: bool = False) -> torch.nn.Module:
    """The tiny pipeline's Wan transformer; ``image``: with Wan 2.1 I2V's image branch."""
    transformer = load_component(tiny_pipeline_folder("wan"), "transformer")
    if not image:
        return transformer
    config = {**transformer.config, "image_dim": 16, "added_kv_proj_dim": 32}
    torch.manual_seed(0)
    return type(transformer).from_config(config)


def tiny_flux() -> torch.nn.Module:
    return load_component(tiny_pipeline_folder("flux"), "transformer")


def flux_width(seed: int = 0, *, double: int = 1, dtype=torch.float32) -> torch.nn.Module:
    """A Flux transformer at Flux.1's width (3072, MLP 12288) with ``double`` double blocks and
    one single block, filled with random values quickly (meta device, then uniform)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(
            in_channels=16,
            num_layers=double,
            num_single_layers=1,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[16, 56, 56],
        ).to(dtype)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.03, 0.03, generator=generator)
    return model


def wan_inputs(model) -> dict:
    generator = torch.Generator().manual_seed(1)
    channels = model.config.in_channels
    inputs = {
        "hidden_states": torch.randn(1, channels, 2, 4, 4, generator=generator),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 5, model.config.text_dim, generator=generator),
    }
    if model.config.image_dim:
        inputs["encoder_hidden_states_image"] = torch.randn(
            1, 3, model.config.image_dim, generator=generator
        )
    return inputs


def flux_inputs(model) -> dict:
    generator = torch.Generator().manual_seed(1)
    config = model.config
    return {
        "hidden_states": torch.randn(1, 16, config.in_channels, generator=generator),
        "encoder_hidden_states": torch.randn(1, 5, config.joint_attention_dim, generator=generator),
        "pooled_projections": torch.randn(1, config.pooled_projection_dim, generator=generator),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(5, 3),
    }


@torch.no_grad()
def outputs(model, inputs) -> torch.Tensor:
    return model.eval()(**inputs, return_dict=False)[0]


def adapted(model, targets, *, rank: int = 4, alpha: int = 8, seed: int = 2):
    """``model`` with LoRA (scale ``alpha / rank`` = 2 by default) whose lora_B are random, so
    the adapters change the outputs."""
    apply_lora(model, LoRAConfig(rank=rank, alpha=alpha, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def export_lora(trained, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Write the trained adapters as the export does; the file's tensors."""
    path = write_original_lora(
        trained, trained.state_dict(), tmp_path / "run.original.lora.safetensors"
    )
    return load_file(path)


def check_loaded(family: str, trained, fresh, inputs, tmp_path: Path) -> None:
    """``pipe.load_lora_weights(<the original-format file>)`` on a pipeline of the tiny folder
    with ``fresh`` as its transformer gives ``trained``'s outputs."""
    from diffusers import DiffusionPipeline

    want, base = outputs(trained, inputs), outputs(fresh, inputs)
    assert (want - base).abs().max() > 1e-2  # the adapters do something
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline_folder(family))
    pipe.transformer = fresh
    pipe.load_lora_weights(str(tmp_path / "run.original.lora.safetensors"))
    assert pipe.transformer is fresh
    torch.testing.assert_close(outputs(fresh, inputs), want, rtol=1e-5, atol=1e-5)


# -- LoRA through diffusers' loaders --------------------------------------------------------
@pytest.mark.parametrize("image", [False, True], ids=["t2v", "i2v"])
def test_wan_original_lora_loads_in_diffusers_as_trained(image: bool, tmp_path: Path) -> None:
    targets = WAN_I2V_TARGETS if image else [*WAN_TARGETS, *WAN_OUTER_TARGETS]
    trained = adapted(tiny_wan(image), targets)
    original = export_lora(trained, tmp_path)
    assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in original
    assert original["diffusion_model.blocks.1.ffn.2.alpha"] == 8  # alpha kept, not baked
    if not image:
        assert "diffusion_model.head.head.lora_B.weight" in original
        assert "diffusion_model.head.head.alpha" not in original
    if image:
        assert "diffusion_model.blocks.0.cross_attn.k_img.lora_B.weight" in original
        assert "diffusion_model.img_emb.proj.1.lora_A.weight" in original
    check_loaded("wan", trained, tiny_wan(image), wan_inputs(trained), tmp_path)


def test_flux_original_lora_fuses_qkv_and_loads_in_diffusers_as_trained(tmp_path: Path) -> None:
    trained = adapted(tiny_flux(), FLUX_TARGETS)
    adapters = adapter_alpha_state(trained, trained.state_dict())
    original = export_lora(trained, tmp_path)
    qkv = "diffusion_model.double_blocks.0.img_attn.qkv"
    down, up = original[f"{qkv}.lora_down.weight"], original[f"{qkv}.lora_up.weight"]
    assert down.shape == (12, 32) and up.shape == (96, 12)  # rank 3 x 4, rows 3 x 32
    assert original[f"{qkv}.alpha"] == 24  # 3 x alpha: alpha / rank stays 2
    assert torch.equal(up[32:64, 4:8], adapters["transformer_blocks.0.attn.to_k.lora_B.weight"])
    assert not up[32:64, :4].count_nonzero()  # block diagonal
    check_loaded("flux", trained, tiny_flux(), flux_inputs(trained), tmp_path)


def test_a_fused_module_with_unadapted_parts_gets_zero_rows(tmp_path: Path) -> None:
    """Only to_q and to_v adapted: the fused qkv's k rows are zero, and diffusers' loader still
    gives the trained outputs."""
    trained = adapted(tiny_flux(), r"^transformer_blocks\.\d+\.attn\.(to_q|to_v)$")
    adapters = adapter_alpha_state(trained, trained.state_dict())
    with pytest.raises(ValueError, match=r"rows=output_rows\(transformer\)"):
        lora_to_original(adapters, FLUX_KEY_MAP)
    original = export_lora(trained, tmp_path)  # passes the transformer's rows
    up = original["diffusion_model.double_blocks.1.img_attn.qkv.lora_up.weight"]
    assert up.shape == (96, 8) and not up[32:64].count_nonzero()
    check_loaded("flux", trained, tiny_flux(), flux_inputs(trained), tmp_path)


@pytest.mark.slow
def test_flux_linear1_at_flux_width_loads_in_diffusers_as_trained(tmp_path: Path) -> None:
    """single_blocks.N.linear1 fuses to_q, to_k, to_v and proj_mlp (rows 3072 x 3 + 12288)."""
    targets = r"^single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp)$"
    trained = adapted(flux_width(double=0), targets)
    original = export_lora(trained, tmp_path)
    assert original["diffusion_model.single_blocks.0.linear1.lora_up.weight"].shape == (21504, 16)
    check_loaded("flux", trained, flux_width(double=0), flux_inputs(trained), tmp_path)


# -- our own inverse --------------------------------------------------------------------------
def test_lora_round_trips_through_the_original_format() -> None:
    for model, targets, key_map in [
        (tiny_wan(image=True), [*WAN_I2V_TARGETS, "proj_out", "time_proj"], WAN_KEY_MAP),
        (tiny_flux(), "all-linear", FLUX_KEY_MAP),  # linear1, final layer, embedders too
    ]:
        trained = adapted(model, targets)
        adapters = adapter_alpha_state(trained, trained.state_dict())
        rows = output_rows(trained)
        original = lora_to_original(adapters, key_map, rows=rows)
        back = lora_from_original(original, key_map, rows=rows)
        assert back.keys() == adapters.keys()
        want, got = scaled(adapters), scaled(back)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=0, msg=key)


def scaled(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lora_A as it is and lora_B times its alpha / rank: what an adapter adds, whether the
    file keeps alpha or carries the scale in lora_B."""
    out = {}
    for key, value in adapters.items():
        module, _, kind = key.partition(".lora_")
        if kind == "B.weight":
            rank = adapters[f"{module}.lora_A.weight"].shape[0]
            value = value * float(adapters[f"{module}.alpha"]) / rank
        if kind:
            out[key] = value
    return out


def test_norm_out_rows_swap_to_the_original_shift_scale_order() -> None:
    """diffusers' norm_out.linear holds (scale, shift), BFL's final_layer (shift, scale)."""
    trained = adapted(tiny_flux(), ["norm_out.linear"])
    adapters = adapter_alpha_state(trained, trained.state_dict())
    up = lora_to_original(adapters, FLUX_KEY_MAP)[
        "diffusion_model.final_layer.adaLN_modulation.1.lora_up.weight"
    ]
    ours = adapters["norm_out.linear.lora_B.weight"]
    assert torch.equal(up, torch.cat([ours[32:], ours[:32]]))


def test_an_unmapped_or_foreign_key_is_refused_by_name() -> None:
    adapter = {
        "pos_embed.lora_A.weight": torch.zeros(2, 4),
        "pos_embed.lora_B.weight": torch.zeros(4, 2),
    }
    with pytest.raises(ValueError, match="no module for the LoRA of pos_embed"):
        lora_to_original(adapter, WAN_KEY_MAP)
    with pytest.raises(ValueError, match=r"lacks the prefix 'diffusion_model\.'"):
        lora_from_original({"blocks.0.self_attn.q.lora_A.weight": torch.zeros(2, 4)}, WAN_KEY_MAP)
    with pytest.raises(ValueError, match=r"'blocks.0.attn1.to_q.lora_B.bias'.*biases"):
        lora_to_original({"blocks.0.attn1.to_q.lora_B.bias": torch.zeros(4)}, WAN_KEY_MAP)


def test_key_maps_by_transformer_class() -> None:
    assert key_map_for("WanTransformer3DModel") is WAN_KEY_MAP
    assert key_map_for(tiny_flux()) is FLUX_KEY_MAP
    assert key_map_for("UNet2DConditionModel") is None


# -- full weights -----------------------------------------------------------------------------
def test_wan_original_weights_load_with_from_single_file(tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    model = tiny_wan(image=True)  # with norm_added_k and the image embedder
    model.save_config(tmp_path / "transformer")
    original = weights_to_original(model.state_dict(), WAN_KEY_MAP)
    assert "blocks.0.cross_attn.norm_k_img.weight" in original
    assert "blocks.1.norm3.weight" in original and "head.modulation" in original
    save_file({k: v.contiguous() for k, v in original.items()}, tmp_path / "wan.safetensors")
    loaded = WanTransformer3DModel.from_single_file(
        str(tmp_path / "wan.safetensors"),
        config=str(tmp_path / "transformer"),
        local_files_only=True,
    )
    inputs = wan_inputs(model)
    torch.testing.assert_close(outputs(loaded, inputs), outputs(model, inputs), rtol=0, atol=0)
    back = weights_from_original(
        load_file(tmp_path / "wan.safetensors"), WAN_KEY_MAP, rows=output_rows(model)
    )
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_flux_weights_round_trip_through_the_original_layout() -> None:
    model = tiny_flux()
    state = model.state_dict()
    original = weights_to_original(state, FLUX_KEY_MAP)
    assert original["single_blocks.0.linear1.weight"].shape == (3 * 32 + 128, 32)
    back = weights_from_original(original, FLUX_KEY_MAP, rows=output_rows(model))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.slow
def test_flux_original_weights_load_with_from_single_file(tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel

    model = flux_width(dtype=torch.bfloat16)  # diffusers splits linear1 at Flux.1's widths
    model.save_config(tmp_path / "transformer")
    original = weights_to_original(model.state_dict(), FLUX_KEY_MAP)
    save_file({k: v.contiguous() for k, v in original.items()}, tmp_path / "flux.safetensors")
    del original
    loaded = FluxTransformer2DModel.from_single_file(
        str(tmp_path / "flux.safetensors"),
        config=str(tmp_path / "transformer"),
        local_files_only=True,
        torch_dtype=torch.bfloat16,
    )
    want, got = model.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)  # equal weights: equal outputs
