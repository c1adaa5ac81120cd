"""`litegen export --from CKPT`: a fine-tuning run checkpoint exported as the end of the run
does; ``litegen.finetune.export`` writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from litegen_cli import render
from litegen_cli.failures import EXIT_BAD_INPUT


def export(
    checkpoint: Annotated[
        Path,
        typer.Option(
            "--from",
            help="A `step_<N>` run checkpoint of a fine-tuning run, or the checkpoint_dir "
            "holding them (its latest).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="The folder to write (must not exist). Default: <checkpoint_dir>/exports/step_<N>.",
            show_default=False,
        ),
    ] = None,
    ema: Annotated[
        bool | None,
        typer.Option(
            "--ema/--no-ema",
            help="Export the EMA weights, or the model's. Default: the run's trainer.export_ema "
            "when the checkpoint holds an EMA.",
            show_default=False,
        ),
    ] = None,
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline",
            help="The pipeline folder the run fine-tuned, if it moved. Default: the run's "
            "finetune.pipeline.",
            show_default=False,
        ),
    ] = None,
    original: Annotated[
        bool,
        typer.Option(
            "--original",
            help="Full fine-tuning: also write the transformer as one safetensors file in the "
            "original model's key layout, <exp_name>.original.safetensors (ComfyUI's "
            "diffusion_models, from_single_file). LoRA runs always write "
            "<exp_name>.original.lora.safetensors where the family's layout is known.",
        ),
    ] = False,
) -> None:
    """Export a fine-tuning run checkpoint as the end of the run does, in this one process.

    Full fine-tuning: a pipeline folder that `DiffusionPipeline.from_pretrained` loads, its
    frozen components linked to the source folder's. LoRA:
    `<exp_name>[.ema].lora.safetensors` (`pipe.load_lora_weights`), the peft folder
    `<exp_name>[.ema].peft` and `<exp_name>[.ema].original.lora.safetensors` (ComfyUI). See
    docs/finetune.md.
    """
    from litegen.finetune.export import export_checkpoint  # imports torch

    try:
        written = export_checkpoint(checkpoint, out, ema=ema, pipeline=pipeline, original=original)
    except (ValueError, FileNotFoundError) as err:
        render.print_error("Cannot export", [str(err)])
        raise typer.Exit(EXIT_BAD_INPUT) from None
    render.console.print(f"[green]Exported[/] {written}", highlight=False)
