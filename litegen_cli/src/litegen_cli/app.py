"""The `litegen` command: the Typer app, its global options, and the one list that registers
the commands. Each command is a module of `litegen_cli/commands/`; adding one is that module
and one line in :data:`COMMANDS`.

torch is never imported at module load: `litegen --help` and `inspect-config` stay fast,
and `launch` imports the launcher (and with it torch) only when it runs.

    python -m litegen_cli.app --help
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import typer

from litegen_cli.commands.cache import cache
from litegen_cli.commands.env import env
from litegen_cli.commands.export import export
from litegen_cli.commands.inspect_config import inspect_config
from litegen_cli.commands.launch import launch
from litegen_cli.commands.resume import resume

app = typer.Typer(
    name="litegen",
    help="Launch and inspect LiteGen training recipes (YAML + an entry module) over torchrun.",
    no_args_is_help=True,
    # `-h` as well as `--help`, on every command and sub-command (Click inherits it).
    context_settings={"help_option_names": ["-h", "--help"]},
    # Errors are printed as panels by the commands; a crash must not dump locals.
    pretty_exceptions_show_locals=False,
    rich_markup_mode="markdown",
    epilog="Examples: litegen inspect-config recipes/digits_dit.yaml max_steps=10 | "
    "litegen launch recipes/digits_dit.yaml launch.nproc_per_node=2",
)

# Every command, in the order `litegen --help` lists them: its name, and its function (a
# command) or its Typer (a group of sub-commands).
COMMANDS: dict[str, Callable[..., None] | typer.Typer] = {
    "launch": launch,
    "resume": resume,
    "inspect-config": inspect_config,
    "env": env,
    "export": export,
    "cache": cache,
}


def _print_version(value: bool) -> None:
    if value:
        from litegen_cli.env_report import version_lines

        typer.echo("\n".join(version_lines()))
        raise typer.Exit()


@app.callback()
def options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the litegen-core and litegen-cli versions and exit.",
        ),
    ] = False,
) -> None:
    """The options before the command (the app's help is the Typer's ``help``)."""


for _name, _command in COMMANDS.items():
    if isinstance(_command, typer.Typer):
        app.add_typer(_command, name=_name)
    else:
        app.command(_name)(_command)


def main() -> None:
    """Console-script entry point (`litegen`).

    Example::

        main()  # same as running `litegen --help`
    """
    app()


if __name__ == "__main__":
    main()
