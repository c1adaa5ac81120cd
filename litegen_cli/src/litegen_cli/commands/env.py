"""`litegen env`: the environment for a bug report; env_report.py builds it."""

from __future__ import annotations

import typer


def env() -> None:
    """Print the environment for a bug report, as Markdown to paste as it is.

    LiteGen's versions, Python, the OS, torch and how it was built (CUDA, cuDNN, NCCL), the
    GPUs and their driver, and the optional packages found.
    """
    from litegen_cli.env_report import environment_report  # imports torch

    typer.echo(environment_report())
