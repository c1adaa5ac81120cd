"""The :class:`Family` interface: what LiteGen knows about one family of diffusers pipelines.

A family is one module of :mod:`litegen.families` with one :class:`Family` subclass. It names
the pipeline and transformer classes, which components train and which stay frozen, the latent
rules (VAE compression in space and time, patch size, normalisation, frame counts), the
conditions the transformer takes and how each is encoded, the training forward, the
sequence-parallel plan, a tiny configuration for tests and how the pipeline draws a validation
sample. A family module imports torch and diffusers inside its methods only: the registry
loads without them, so the CLI checks a fine-tuning recipe before any rank starts without
importing torch. The fine-tuning road (:mod:`litegen.finetune`), the built-in sequence plans, the zoo's
real models and ``litegen_zoo.make_tiny_pipeline`` read these declarations.

Example::

    from litegen.families import family_for_pipeline

    family = family_for_pipeline("WanPipeline")(scheduler_config)
    loss = family.loss(transformer, {"latents": x0, "prompt_embeds": text}, objective)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from litegen.data import MediaBuckets
from litegen.model_keys.key_map import KeyMap

if TYPE_CHECKING:
    import torch

    from litegen.objectives import FlowMatching
    from litegen.parallel.sequence.sequence_plan import SequencePlan


@dataclasses.dataclass(frozen=True)
class LatentRules:
    """How pixels become the transformer's tokens.

    ``temporal_compression`` is None for an image family (one frame per sample). A video's
    frame count must be ``k * temporal_compression + 1``: the VAE keeps the first frame alone.

    Example:
        >>> rules = LatentRules(8, 2, "(z - mean) / std", temporal_compression=4)
        >>> rules.spatial_multiple, rules.is_video
        (16, True)
    """

    spatial_compression: int
    patch_size: int
    normalisation: str  # how the VAE's latents are scaled, in words (for the docs)
    temporal_compression: int | None = None

    @property
    def spatial_multiple(self) -> int:
        """Pixel sides must be multiples of this: VAE downsampling x patch size."""
        return self.spatial_compression * self.patch_size

    @property
    def is_video(self) -> bool:
        return self.temporal_compression is not None


@dataclasses.dataclass(frozen=True)
class MediaCondition:
    """A file a sample brings beside its clip and caption, that the transformer is
    conditioned on: a first frame, a reference image, a control video.

    The media folder gives it per file, under the condition's name (a ``metadata.jsonl``/
    ``.csv`` column, or a companion file ``<stem>.<name>.<ext>``; docs/finetune.md). ``kind``
    says what the file is: an image, read at the clip's bucket size, or a video, read at the
    clip's frames and size. ``default="first_frame"`` takes the clip's own frame 0 when the
    file gives none (how image-to-video trains on plain clips). ``optional`` lets the whole
    folder go without it; a condition that is neither is required of every file. Its name
    must be one of :data:`litegen.data.CONDITION_NAMES`.

    Example:
        >>> first = MediaCondition("image", "the first frame", default="first_frame")
        >>> first.required
        False
    """

    kind: Literal["image", "video"]
    description: str  # what it conditions and how it is encoded, in words (for the docs)
    default: Literal["first_frame"] | None = None
    optional: bool = False

    @property
    def required(self) -> bool:
        """Every file must give it: there is no default and the family cannot go without."""
        return self.default is None and not self.optional


class Family:
    """One family of pipelines: subclass it in a module of :mod:`litegen.families`.

    Class attributes declare the family; methods encode, predict and sample. An instance
    carries the pipeline's scheduler config: a dynamic-shifting one (Flux) shifts the noise
    levels by the latent sequence length, as the pipeline does when it samples.

    ``original_keys`` maps the transformer's diffusers module names to the original
    checkpoint's (ComfyUI's ``diffusion_model.<module>`` names), for LoRA files (q/k/v fused
    where the original fuses them, alpha kept) and full weights; None while the family has none.

    ``conditions`` names the tensors ``predict`` reads from the batch beside ``latents``, and
    how each is encoded (for the docs). ``media_conditions`` declares the files beyond the
    caption a sample brings (:class:`MediaCondition`, by name): the fine-tuning road reads each
    at the clip's bucket, hands it to :meth:`encode_condition` with the clip (and all of them
    to :meth:`encode_text_with` with the captions), caches what those return with the
    latents, and the DataLoader brings those tensors to ``predict`` in ``batch``. Validation
    samples get the same conditions, one file per prompt, in :meth:`sample`'s ``conditions``.
    """

    name: ClassVar[str]  # the short name: wan, flux
    pipeline_class: ClassVar[str]  # model_index.json's _class_name
    transformer_class: ClassVar[str]  # the diffusers class of the trained component
    trained: ClassVar[tuple[str, ...]] = ("transformer",)
    frozen: ClassVar[tuple[str, ...]] = ()  # the pipeline's other modules, never trained
    latent: ClassVar[LatentRules]
    conditions: ClassVar[dict[str, str]] = {}  # batch tensor name -> how it is encoded
    media_conditions: ClassVar[dict[str, MediaCondition]] = {}  # files a sample brings
    reference_config: ClassVar[dict[str, Any]] = {}  # the published transformer's config
    tiny_config: ClassVar[dict[str, Any]] = {}  # the tiny transformer's config, for tests
    original_keys: ClassVar[KeyMap | None] = None  # the original checkpoint's module names
    # model_index.json entries that must be set (not null or false) for this family: what tells
    # it apart from another family of the same pipeline class (Wan 2.2's transformer_2).
    model_index_keys: ClassVar[tuple[str, ...]] = ()
    # What diffusers cannot read of the tiny pipeline's exports, with why: "original_lora"
    # (load_lora_weights of <name>.original.lora.safetensors), "original_weights"
    # (from_single_file of <name>.original.safetensors). The family matrix skips those checks
    # with the reason (tests/distributed/test_family_matrix.py).
    tiny_export_limits: ClassVar[dict[str, str]] = {}
    # Pipeline components that LiteGen does not load from a folder (``from_pretrained`` is
    # given None for each): the family supplies them where it needs them (Qwen-Image-Edit's
    # processor, which transformers builds only with torchvision).
    unloaded_components: ClassVar[tuple[str, ...]] = ()

    def __init__(self, scheduler_config: dict[str, Any] | None = None) -> None:
        self.scheduler_config = dict(scheduler_config or {})

    # -- what the family is made of ---------------------------------------------------------
    @classmethod
    def matches(cls, model_index: dict[str, Any]) -> bool:
        """True when ``model_index`` (a ``model_index.json``) sets every :attr:`model_index_keys`."""
        return all(
            model_index.get(key) not in (None, False, [None, None]) for key in cls.model_index_keys
        )

    @classmethod
    def tiny_pipeline(cls, seed: int = 0) -> Any:
        """The tiny pipeline (random weights, built offline) that trains on a CPU in seconds."""
        raise NotImplementedError

    @classmethod
    def sequence_plan(cls, model: torch.nn.Module) -> SequencePlan | None:
        """The transformer's sequence-parallel plan, or None when it has none."""
        return None

    # -- data -------------------------------------------------------------------------------
    def buckets(self, vae_config: dict[str, Any], data: Any) -> MediaBuckets:
        """The bucket rule at the data settings (``resolution``, ``max_frames``,
        ``frame_stride``); an image family trains one frame per sample."""
        if not self.latent.is_video:
            return MediaBuckets(
                resolution=data.resolution, spatial_multiple=self.latent.spatial_multiple
            )
        return MediaBuckets(
            resolution=data.resolution,
            spatial_multiple=self.latent.spatial_multiple,
            max_frames=data.max_frames,
            temporal_compression=self.temporal_compression(vae_config),
            frame_stride=data.frame_stride,
        )

    def temporal_compression(self, vae_config: dict[str, Any]) -> int:
        """The VAE's compression in time, from its config where it says (default: the rule's)."""
        return self.latent.temporal_compression or 1

    def encode_latents(
        self, pipe: Any, pixels: torch.Tensor, micro_batch_size: int
    ) -> torch.Tensor:
        """Latents of a batch of one shape, normalised as the pipeline's decode expects; the
        VAE sees ``micro_batch_size`` samples at a time."""
        raise NotImplementedError

    def encode_text(self, pipe: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """The text conditions the transformer takes, one row per caption."""
        raise NotImplementedError

    def encode_text_with(
        self, pipe: Any, captions: list[str], conditions: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The text conditions of ``captions``, whose samples bring the media conditions'
        ``conditions`` (pixels by name, as :meth:`encode_condition` gets them): the captions
        alone (:meth:`encode_text`) unless the family's text encoder reads a condition too
        (Qwen-Image-Edit's reads the reference image). Such a family also returns the empty
        caption's text with the same conditions, each under :func:`empty_caption_key` of its
        name: caption dropout swaps in those rows rather than the one empty caption's."""
        return self.encode_text(pipe, captions)

    def encode_condition(
        self, pipe: Any, name: str, pixels: torch.Tensor, clip: torch.Tensor, micro_batch_size: int
    ) -> dict[str, torch.Tensor]:
        """The cached tensors of media condition ``name``, one row per sample: ``pixels`` are
        the condition's files in [-1, 1] at the clip's bucket (images ``(N, C, H, W)``, videos
        ``(N, C, T, H, W)``), ``clip`` the clips they go with (``(N, C, T, H, W)`` for a video
        family, ``(N, C, H, W)`` for an image one). The names returned must not clash with
        ``latents`` or the text tensors; ``predict`` finds them in ``batch``."""
        raise NotImplementedError(f"{type(self).__name__} declares no media condition {name!r}")

    # -- training ---------------------------------------------------------------------------
    def shift_for(self, seq_len: int) -> float | None:
        """The shift the pipeline samples ``seq_len`` tokens with, if it shifts by resolution."""
        from litegen.objectives import resolution_shift

        config = self.scheduler_config
        if not config.get("use_dynamic_shifting"):
            return None  # the objective's own shift, from the config
        return resolution_shift(
            seq_len,
            base_seq_len=config.get("base_image_seq_len", 256),
            max_seq_len=config.get("max_image_seq_len", 4096),
            base_shift=config.get("base_shift", 0.5),
            max_shift=config.get("max_shift", 1.15),
        )

    def seq_len(self, latents: torch.Tensor) -> int:
        """The transformer's token count for a batch of latents."""
        p = self.latent.patch_size
        return latents[0, 0].numel() // (p * p)

    def predict(
        self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The transformer's velocity at noise levels ``sigmas`` (in [0, 1], one per sample),
        in the layout of ``noisy``; ``batch`` holds the encoded conditions."""
        raise NotImplementedError

    def loss(
        self, model: Any, batch: dict[str, torch.Tensor], objective: FlowMatching
    ) -> torch.Tensor:
        """The flow-matching loss of a batch of cached latents and conditions."""
        import torch

        x0 = batch["latents"].float()
        noise = torch.randn_like(x0)
        shift = self.shift_for(self.seq_len(x0))
        sigmas = objective.sample_sigmas(x0.shape[0], device=x0.device, shift=shift)
        noisy = objective.add_noise(x0, noise, sigmas)
        prediction = self.predict(model, noisy, sigmas, batch)
        return objective.loss(prediction, x0, noise, sigmas)

    # -- sampling ---------------------------------------------------------------------------
    def sample(
        self,
        pipe: Any,
        prompts: list[str],
        validation: Any,
        generator: torch.Generator,
        conditions: dict[str, list[Any]] | None = None,
    ) -> torch.Tensor:
        """Samples of ``prompts``: images ``(N, C, H, W)`` or videos ``(N, C, T, H, W)`` in
        [0, 1], at ``validation``'s settings (``trainer.validation``). ``conditions`` holds
        each media condition's input, one per prompt, as diffusers pipelines take them: a
        ``PIL.Image`` for an image, a list of them for a video (``trainer.validation.conditions``;
        the fine-tuning road passes it only to a family with media conditions)."""
        raise NotImplementedError

    def inputs_per_prompt(
        self, conditions: dict[str, list[Any]] | None, name: str, prompts: list[str]
    ) -> list[Any]:
        """The validation inputs of media condition ``name``, one per prompt, for :meth:`sample`;
        a ValueError naming the setting when they are missing or not one per prompt."""
        inputs = (conditions or {}).get(name)
        if inputs is None or len(inputs) != len(prompts):
            given = 0 if inputs is None else len(inputs)
            raise ValueError(
                f"{self.pipeline_class} samples take one {name} file per prompt ({given} for "
                f"{len(prompts)} prompts): give trainer.validation.conditions.{name}, one file "
                "per prompt."
            )
        return inputs


def empty_caption_key(name: str) -> str:
    """The batch name of text tensor ``name`` of the empty caption with a sample's own
    conditions (:meth:`Family.encode_text_with`).

    Example:
        >>> empty_caption_key("prompt_embeds")
        'empty_caption.prompt_embeds'
    """
    return f"empty_caption.{name}"


def max_length(tokenizer: Any) -> int:
    """The tokenizer's length, at most 512 (a tokenizer without one says 10^30)."""
    return min(int(tokenizer.model_max_length), 512)


def pipeline_settings(validation: Any, **more: Any) -> dict[str, Any]:
    """The pipeline arguments ``trainer.validation`` sets; the unset ones keep their defaults."""
    given = {
        "height": validation.height,
        "width": validation.width,
        "num_inference_steps": validation.steps,
        "guidance_scale": validation.guidance,
        **more,
    }
    return {name: value for name, value in given.items() if value is not None}


def model_config(model: Any) -> Any:
    """The diffusers config of ``model``, inside a DDP or FSDP1 wrapper if need be."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model.config


def model_dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype  # bf16 under the bf16-mixed preset


__all__ = [
    "Family",
    "LatentRules",
    "MediaCondition",
    "empty_caption_key",
    "max_length",
    "model_config",
    "model_dtype",
    "pipeline_settings",
]
