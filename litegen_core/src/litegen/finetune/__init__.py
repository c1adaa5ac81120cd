"""The fine-tuning road: train the transformer of a diffusers pipeline folder on a folder of
images and videos with captions, as a recipe's entry (``launch.entry: litegen.finetune``).

    uv run litegen cache build recipes/finetune_video.yaml finetune.pipeline=DIR finetune.data.folder=MEDIA
    uv run litegen launch recipes/finetune_video.yaml finetune.pipeline=DIR finetune.data.folder=MEDIA

The ``finetune`` section of the config (:class:`litegen.config.finetune.FinetuneConfig`) says
what to train on; the pipeline class of ``finetune.pipeline`` picks the family
(:mod:`litegen.families`). The modules, by responsibility:

- :mod:`~litegen.finetune.pipeline`: the folder, its family, transformer and objective;
- :mod:`~litegen.finetune.media`: the media dataset and its checks from a scan;
- :mod:`~litegen.finetune.cache`: the latent cache (keys, encoding, reading);
- :mod:`~litegen.finetune.training`: ``build``, ``train_step``, the LR schedule, caption dropout;
- :mod:`~litegen.finetune.sampling`: validation samples and the export at the end;
- :mod:`~litegen.finetune.checks`: ``check_inputs``, before any rank starts.

Training reads the cache alone: the VAE and text encoders are loaded again only to sample. The
loss is flow matching with the pipeline scheduler's shift. At the end, ``finish`` writes
``<results_dir>/pipeline`` (full fine-tuning) or ``<results_dir>/lora`` (the LoRA adapters).
"""

from litegen.finetune.cache import build_cache
from litegen.finetune.checks import check_inputs
from litegen.finetune.sampling import finish, sample
from litegen.finetune.training import CaptionDropout, build, train_step

__all__ = [
    "CaptionDropout",
    "build",
    "build_cache",
    "check_inputs",
    "finish",
    "sample",
    "train_step",
]
