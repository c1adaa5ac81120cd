"""One real diffusers transformer: its class, a published and a tiny config, batches and loss.

A :class:`RealModel` names a diffusers class, the published config of a reference checkpoint
and a tiny config of the same class (both as constructor kwargs, built with random weights,
nothing downloaded), the latent size each is used at, how to make a synthetic batch of the
inputs its ``forward`` needs, and a flow-matching loss over its prediction. The architectures
themselves are the rows of ``real_models.REAL_MODELS``.

A batch is a dict of tensors that all lead with the batch dimension (clean latents, noise, the
flow time ``t`` in [0, 1], and the model's conditions: text embeddings, masks, pooled
projections, class labels, guidance), so ``{k: v[i] for k, v in batch.items()}`` is one sample
and a DataLoader's default collate stacks samples back. Whatever follows from the latent size
(Flux's token ids, LTX's frame count) is made by :meth:`RealModel.predict` at call time.

Example:
    >>> from litegen_zoo.real_models import REAL_MODELS
    >>> spec = REAL_MODELS["sd3"]
    >>> spec.loss(spec.build("tiny"), spec.batch("tiny", batch_size=2)).ndim
    0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from litegen_zoo.real_model_inputs import Batch, LatentShape, unwrapped

Size = Literal["tiny", "reference"]


@dataclass(frozen=True)
class RealModel:
    """A diffusers transformer class with a reference and a tiny config, its inputs and loss.

    ``conditions(config, shape, batch_size, generator)`` makes the per-sample conditions;
    ``run(model, config, noisy, timestep, batch)`` calls ``forward`` and returns the prediction
    in the layout of ``batch["latents"]``. ``latent_layout`` names the latents' dimensions
    (b batch, c channels, f frames, h height, w width).

    Example:
        >>> from litegen_zoo.real_models import REAL_MODELS
        >>> REAL_MODELS["dit"].build("reference").config.num_layers
        28
    """

    name: str
    class_name: str
    reference: dict[str, Any]
    tiny: dict[str, Any]
    reference_shape: LatentShape
    tiny_shape: LatentShape
    latent_layout: Literal["bchw", "bcfhw", "bfchw"]
    conditions: Callable[[dict[str, Any], LatentShape, int, torch.Generator], Batch]
    run: Callable[[nn.Module, dict[str, Any], torch.Tensor, torch.Tensor, Batch], torch.Tensor]
    # Latent channels per input channel of the model: Flux packs 2x2 latent pixels per token.
    latent_channels_per_input: float = 1.0

    def config(self, size: Size = "tiny") -> dict[str, Any]:
        """The constructor kwargs of ``size`` (a copy)."""
        return dict(self.reference if size == "reference" else self.tiny)

    def shape(self, size: Size = "tiny") -> LatentShape:
        return self.reference_shape if size == "reference" else self.tiny_shape

    def model_class(self) -> type[nn.Module]:
        """The diffusers class (importing it takes seconds: do it before forking ranks)."""
        import diffusers

        return getattr(diffusers, self.class_name)

    def build(self, size: Size = "tiny", seed: int = 0, **overrides: Any) -> nn.Module:
        """The model with random weights; the same weights for the same seed.

        Example:
            >>> from litegen_zoo.real_models import REAL_MODELS
            >>> REAL_MODELS["wan"].build("tiny", num_layers=3).config.num_layers
            3
        """
        torch.manual_seed(seed)
        return self.model_class()(**(self.config(size) | overrides))

    def batch(
        self,
        size: Size = "tiny",
        batch_size: int = 2,
        seed: int = 0,
        shape: LatentShape | None = None,
        config: dict[str, Any] | None = None,
    ) -> Batch:
        """A synthetic batch for the ``size`` config (or ``config``) at ``shape``, on the CPU.

        Example:
            >>> from litegen_zoo.real_models import REAL_MODELS
            >>> REAL_MODELS["dit"].batch("tiny", batch_size=4)["latents"].shape
            torch.Size([4, 4, 8, 8])
        """
        config = config or self.config(size)
        shape = shape or self.shape(size)
        gen = torch.Generator().manual_seed(seed)
        channels = int(config["in_channels"] * self.latent_channels_per_input)
        dims = {"b": batch_size, "c": channels, "f": shape.frames}
        dims |= {"h": shape.height, "w": shape.width}
        latent_size = [dims[d] for d in self.latent_layout]
        return {
            "latents": torch.randn(latent_size, generator=gen),
            "noise": torch.randn(latent_size, generator=gen),
            "t": torch.rand(batch_size, generator=gen),
        } | self.conditions(config, shape, batch_size, gen)

    def predict(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The model's velocity prediction at ``noisy = (1 - t) * latents + t * noise``."""
        config = dict(unwrapped(model).config)
        dtype = next(model.parameters()).dtype
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        t = batch["t"].view(-1, *[1] * (batch["latents"].ndim - 1))
        noisy = (1 - t) * batch["latents"] + t * batch["noise"]
        return self.run(model, config, noisy, batch["t"], batch)

    @staticmethod
    def target(batch: Batch) -> torch.Tensor:
        """The flow-matching velocity the prediction regresses to."""
        return batch["noise"] - batch["latents"]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean squared error of the prediction against :meth:`target`, in fp32."""
        prediction = self.predict(model, batch).float()
        return nn.functional.mse_loss(prediction, self.target(batch).float())
