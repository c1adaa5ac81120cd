"""Validation samples and the export at the end of a fine-tuning run.

Example::

    grid = sample(model, gen, config, family)   # every trainer.sample_every steps
    finish(gen, config, model)                  # <results_dir>/pipeline or <results_dir>/lora
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from litegen.checkpoint.layout import END_OF_RUN_DIRS
from litegen.families import Family
from litegen.finetune.expert_models import Experts, install_experts, write_expert_exports
from litegen.finetune.export import export_name, write_export
from litegen.finetune.pipeline import frozen_pipeline, pipeline_folder

_, PIPELINE_DIR, LORA_DIR = END_OF_RUN_DIRS  # the exports of full fine-tuning and of LoRA
_sampling_pipes: dict[str, Any] = {}  # loaded at the first sample() and kept for the next ones


def read_condition(path: str) -> Any:
    """A validation condition file as diffusers pipelines take it: a ``PIL.Image`` (RGB) for
    an image, the list of its frames for a video."""
    from PIL import Image

    from litegen.data.media_files import VIDEO_SUFFIXES

    if Path(path).suffix.lower() not in VIDEO_SUFFIXES:
        with Image.open(path) as image:
            return image.convert("RGB")
    import av

    with av.open(path) as container:
        return [frame.to_image() for frame in container.decode(container.streams.video[0])]


def validation_conditions(config: Any) -> dict[str, list[Any]]:
    """``trainer.validation.conditions`` read: per condition, one input per prompt."""
    given = config.trainer.validation.conditions
    return {name: [read_condition(path) for path in given[name]] for name in given}


def sample(model: Any, gen: Any, config: Any, family: Family) -> torch.Tensor:
    """The validation prompts through the family's pipeline, with the weights being trained
    (or EMA).

    The VAE and text encoders (bf16 on a GPU) come to the device for the call and go back to
    the CPU after it, so training keeps their memory between samples.
    """
    validation = config.trainer.validation
    folder = str(pipeline_folder(config))
    if folder not in _sampling_pipes:
        dtype = torch.bfloat16 if gen.device.type == "cuda" else None
        pipe = frozen_pipeline(config, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        _sampling_pipes[folder] = pipe
    pipe = _sampling_pipes[folder]
    trained = {"transformer"}
    if isinstance(gen.unwrap(model), Experts):
        trained = install_experts(pipe, gen.unwrap(model), folder)
    else:
        pipe.transformer = gen.unwrap(model)
    frozen = [
        module
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module) and name not in trained
    ]
    for module in frozen:
        module.to(gen.device)
    try:
        generator = torch.Generator(gen.device).manual_seed(int(validation.seed))
        prompts = list(validation.prompts)
        if not family.media_conditions:
            return family.sample(pipe, prompts, validation, generator)
        conditions = validation_conditions(config)
        return family.sample(pipe, prompts, validation, generator, conditions=conditions)
    finally:
        for module in frozen:
            module.to("cpu")


def finish(gen: Any, config: Any, model: Any) -> None:
    """Export (:func:`litegen.finetune.export.write_export`, as ``litegen export`` does from a
    checkpoint): the pipeline folder with the trained transformer, or the LoRA adapters."""
    use_ema = config.trainer.export_ema and gen.ema is not None
    lora = config.optimization.lora
    if use_ema:  # a LoRA model's EMA averages the adapters alone: no need to gather the base
        state = gen.ema.state_dict() if lora is not None else gen.full_ema_state()
    else:
        state = gen.full_model_state(model)  # every rank gathers
    out = Path(config.get_results_dir()) / (LORA_DIR if lora is not None else PIPELINE_DIR)
    if gen.is_main_process:
        name = export_name(config.exp_name, use_ema)
        prefix = lora.prefix if lora is not None else "transformer"
        if isinstance(gen.unwrap(model), Experts):
            write_expert_exports(gen.unwrap(model), state, pipeline_folder(config), out,
                                 name=name, lora_prefix=prefix, write_one=write_export)  # fmt: skip
            return
        write_export(gen.unwrap(model), state, pipeline_folder(config), out, name=name,
                     lora_prefix=prefix)  # fmt: skip


__all__ = ["finish", "sample"]
