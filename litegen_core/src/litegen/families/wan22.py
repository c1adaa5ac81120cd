"""Wan 2.2 A14B text-to-video: two experts (``WanPipeline`` with ``transformer``,
``transformer_2`` and ``boundary_ratio``).

The high-noise expert ``transformer`` denoises at timesteps ``t >= boundary_ratio * 1000``
(0.875 for T2V-A14B), the low-noise expert ``transformer_2`` below; both are
``WanTransformer3DModel`` of Wan 2.1's layout, so latents, text, the training forward and the
original key names are Wan 2.1's (:mod:`litegen.families.wan`), and the VAE is Wan 2.1's (z_dim
16, 8x in space, 4x in time). ``finetune.experts`` picks the experts a run trains; each trains
on the noise levels of its range only (:mod:`litegen.finetune.expert_models`), and each gets
its own export (``<name>.high_noise.*``, ``<name>.low_noise.*``). The registry tells this family
from Wan 2.1 by ``transformer_2`` and ``boundary_ratio`` in ``model_index.json``; by
transformer class alone it finds Wan 2.1 (the class is the same).

Limits: no sequence parallelism yet (the experts train as one module,
:class:`~litegen.finetune.expert_models.Experts`, which has no plan: ``sp_size`` > 1 is refused
by the plan lookup).

Image-to-video A14B (:class:`Wan22I2V`, ``WanImageToVideoPipeline`` with two experts,
``boundary_ratio`` 0.9) is Wan 2.1 I2V's first-frame road without the CLIP image embedding:
the ``image`` condition (the clip's frame 0 by default) gives the first-frame mask and latents
on channels (36 = 16 noisy + 4 mask + 16 first-frame), as the pipeline builds them.

Example::

    from litegen.families.wan22 import Wan22

    pipe = Wan22.tiny_pipeline()  # a WanPipeline with two tiny experts, boundary_ratio 0.875
"""

from __future__ import annotations

from typing import Any, ClassVar

from litegen.families.base import model_dtype
from litegen.families.wan import Wan, WanI2V


class Wan22(Wan):
    """Wan 2.2 A14B text-to-video: Wan 2.1's latents and text, two experts split by noise level."""

    name = "wan22"
    trained = ("transformer", "transformer_2")
    model_index_keys = ("transformer_2", "boundary_ratio")
    reference_config: ClassVar[dict[str, Any]] = {  # Wan-AI/Wan2.2-T2V-A14B-Diffusers, each expert
        "patch_size": (1, 2, 2),
        "num_attention_heads": 40,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 13824,
        "num_layers": 40,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }
    boundary_ratio: ClassVar[float] = 0.875  # T2V-A14B's; I2V-A14B's is 0.9

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """Wan 2.1's tiny pipeline with a second tiny expert and ``boundary_ratio``."""
        import torch
        from diffusers import WanPipeline, WanTransformer3DModel

        one = Wan.tiny_pipeline(seed)
        torch.manual_seed(seed + 1)
        return WanPipeline(
            tokenizer=one.tokenizer,
            text_encoder=one.text_encoder,
            transformer=one.transformer,
            transformer_2=WanTransformer3DModel(**cls.tiny_config),
            vae=one.vae,
            scheduler=one.scheduler,
            boundary_ratio=cls.boundary_ratio,
        )


class Wan22I2V(WanI2V):
    """Wan 2.2 I2V-A14B: two experts, each Wan 2.1 I2V's channels-first first frame, no CLIP."""

    name = "wan22_i2v"
    trained = ("transformer", "transformer_2")
    frozen = ("vae", "text_encoder")
    model_index_keys = ("transformer_2", "boundary_ratio")
    conditions: ClassVar[dict[str, str]] = {
        name: how for name, how in WanI2V.conditions.items() if name != "image_embeds"
    }
    reference_config: ClassVar[dict[str, Any]] = {  # Wan-AI/Wan2.2-I2V-A14B-Diffusers, each expert
        **Wan22.reference_config,
        "in_channels": 36,  # 16 noisy + 4 mask + 16 first-frame latents
    }
    tiny_config: ClassVar[dict[str, Any]] = {**Wan.tiny_config, "in_channels": 12}
    boundary_ratio: ClassVar[float] = 0.9  # I2V-A14B's

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """A ``WanImageToVideoPipeline`` with two tiny experts, no image encoder."""
        import torch
        from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

        one = Wan.tiny_pipeline(seed)
        torch.manual_seed(seed + 1)
        experts = [WanTransformer3DModel(**cls.tiny_config) for _ in range(2)]
        return WanImageToVideoPipeline(
            tokenizer=one.tokenizer,
            text_encoder=one.text_encoder,
            vae=one.vae,
            scheduler=one.scheduler,
            transformer=experts[0],
            transformer_2=experts[1],
            boundary_ratio=cls.boundary_ratio,
        )

    def encode_condition(self, pipe, name, pixels, clip, micro_batch_size):
        """The first-frame mask and latents (Wan 2.1 I2V's), without the CLIP embedding."""
        import torch

        if name != "image":
            return super().encode_condition(pipe, name, pixels, clip, micro_batch_size)
        frames = clip.shape[2] if clip.dim() == 5 else 1
        black = pixels.new_zeros(pixels.shape[0], pixels.shape[1], frames - 1, *pixels.shape[2:])
        latents = self.encode_latents(pipe, torch.cat([pixels.unsqueeze(2), black], dim=2),
                                      micro_batch_size)  # fmt: skip
        mask = torch.zeros_like(latents[:, :1]).repeat(1, pipe.vae_scale_factor_temporal, 1, 1, 1)
        mask[:, :, 0] = 1  # the latent frame of the given first frame
        return {"first_frame": torch.cat([mask, latents], dim=1)}

    def predict(self, model, noisy, sigmas, batch):
        import torch

        dtype = model_dtype(model)
        hidden = torch.cat([noisy, batch["first_frame"].to(noisy)], dim=1)
        return model(
            hidden_states=hidden.to(dtype),
            timestep=sigmas * 1000,
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]


__all__ = ["Wan22", "Wan22I2V"]
