"""The job's prepared models: what ``prepare`` returned, the EMA of the first trainable one and
the key prefix of its adapter files.

The runtime fills it; the checkpointer and the runtime's own methods look models up in it.

Example::

    prepared = PreparedModels()
    prepared.models.append(entry)
    prepared.entry()  # the first trainable model's entry
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from litegen.runtime.prepare_arguments import PreparedModel

if TYPE_CHECKING:
    from litegen.ema import EMA


@dataclass
class PreparedModels:
    """The prepared models in preparation order, the EMA and the adapter-file key prefix.

    ``lora_prefix`` is ``optimization.lora.prefix`` of the profile that applied the adapters.

    Example::

        PreparedModels(lora_prefix="transformer").trainable()  # []
    """

    models: list[PreparedModel] = field(default_factory=list)
    ema: EMA | None = None
    lora_prefix: str = "transformer"

    def trainable(self) -> list[PreparedModel]:
        """The trainable models, in preparation order."""
        return [m for m in self.models if m.trainable]

    def entry(self, model: nn.Module | None = None) -> PreparedModel:
        """The entry of a prepared ``model``; the first trainable one's when ``model`` is None.

        A ValueError names the fix for a model ``prepare`` never returned.
        """
        if model is None:
            trainable = self.trainable()
            if not trainable:
                raise ValueError("no trainable model has been prepared yet; call prepare first.")
            return trainable[0]
        for entry in self.models:
            if entry.module is model:
                return entry
        raise ValueError("this model was not returned by gen.prepare; pass the prepared model.")
