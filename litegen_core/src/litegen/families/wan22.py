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
by the plan lookup); image-to-video A14B (``WanImageToVideoPipeline``) is not a family here yet.

Example::

    from litegen.families.wan22 import Wan22

    pipe = Wan22.tiny_pipeline()  # a WanPipeline with two tiny experts, boundary_ratio 0.875
"""

from __future__ import annotations

from typing import Any, ClassVar

from litegen.families.wan import Wan


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


__all__ = ["Wan22"]
