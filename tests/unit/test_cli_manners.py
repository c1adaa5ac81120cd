"""The `litegen` command's manners: --version, env, shell completion, help without hard breaks."""

from __future__ import annotations

import itertools
import platform

import click
import pytest
import typer
from typer.testing import CliRunner

from litegen_cli.app import app
from litegen_cli.env_report import OPTIONAL_PACKAGES, distribution_version, optional_package

runner = CliRunner()
BOX = tuple("│╭╰")


def registered_commands() -> list[tuple[list[str], click.Command]]:
    """Every command and group the app registers, as the words that call it (``[]`` is
    `litegen` itself) and its Click command, read from the tree Typer builds for the app."""

    def walk(command: click.Command, words: list[str]):
        yield words, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*words, name])

    return list(walk(typer.main.get_command(app), []))


def invoke(*args: str, **env: str):
    return runner.invoke(app, list(args), prog_name="litegen", env=env or None)


def test_version_names_both_packages():
    result = invoke("--version")
    assert result.exit_code == 0, result.output
    # Run from a source checkout without installing (PYTHONPATH), a package reads "not installed".
    expected = [
        f"{name} {distribution_version(name) or 'not installed'}"
        for name in ("litegen-core", "litegen-cli")
    ]
    assert result.output.splitlines() == expected


def test_env_reports_versions_hardware_and_optional_packages():
    import torch

    result = invoke("env")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "## LiteGen environment"
    expected = [
        f"- litegen-core: {distribution_version('litegen-core') or 'not installed'}",
        f"- Python: {platform.python_version()} ({platform.python_implementation()})",
        f"- torch: {torch.__version__} (CUDA build: {torch.version.cuda or 'CPU only'})",
        f"- CUDA available: {'yes' if torch.cuda.is_available() else 'no'}",
        f"- diffusers: {distribution_version('diffusers')}",
        "### Optional packages",
    ]
    for line in expected:
        assert line in lines, line
    assert any(line.startswith("- NCCL: ") for line in lines)
    for module in OPTIONAL_PACKAGES:
        assert any(line.startswith(f"- {module}: ") for line in lines), module
    assert optional_package("litegen_no_such_module", "no-such") == "not installed"


def test_completion_script_and_answers(monkeypatch):
    # Typer detects the shell from the process tree, which a detached run (setsid) lacks.
    monkeypatch.setattr("typer.completion._get_shell_name", lambda: "bash")
    script = invoke("--show-completion")
    assert script.exit_code == 0, script.output
    assert "complete -o default -F _litegen_completion litegen" in script.output
    answer = invoke(_LITEGEN_COMPLETE="complete_bash", COMP_WORDS="litegen insp", COMP_CWORD="1")
    assert answer.output.split() == ["inspect-config"]


def hard_breaks(text: str, width: int) -> list[str]:
    """Prose lines that end although the next line's first word would still have fit: a line
    break written in the help text rather than made by the renderer."""
    lines = [line.rstrip() for line in text.splitlines()]
    found = []
    for line, following in itertools.pairwise(lines):
        if not line.strip() or not following.strip() or line.lstrip().startswith(BOX):
            continue
        if following.lstrip().startswith(BOX):
            continue
        # Rich keeps one column of padding on each side of the help text.
        if len(line) + 1 + len(following.split()[0]) <= width - 2:
            found.append(line)
    return found


@pytest.mark.parametrize("width", [80, 120])
def test_help_paragraphs_are_not_broken_mid_sentence(width):
    for words, _ in registered_commands():
        result = invoke(*words, "--help", COLUMNS=str(width))
        assert result.exit_code == 0, result.output
        assert not hard_breaks(result.output, width), (words, hard_breaks(result.output, width))
