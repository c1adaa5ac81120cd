"""Writes the summary table of benchmarks/README.md from the header blocks of the result files.

Every result file, ``benchmarks/YYYY-MM-DD-<slug>.md``, opens with its title and a header block
of ``- Field: value`` lines (benchmarks/README.md shows it); the summary has one row per file,
latest first, between the README's two marker comments. Run from the repository root:

    uv run --locked python -m scripts.bench.benchmarks_summary          # rewrite the summary
    uv run --locked python -m scripts.bench.benchmarks_summary --check  # exit 1 if it is stale

A result file that lacks a header field is an error (exit 2) naming the file and the field.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from dataclasses import dataclass
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "benchmarks"
FIELDS = ("Date", "Hardware", "torch", "Versions", "Headline", "Commands")
START = "<!-- summary:start: written by scripts/bench/benchmarks_summary.py, do not edit -->"
END = "<!-- summary:end -->"
FILE_NAME = re.compile(r"(\d{4}-\d{2}-\d{2})-[a-z0-9]+(?:-[a-z0-9]+)*\.md")
FIELD_LINE = re.compile(rf"- ({'|'.join(FIELDS)}):[ \t]*(.*)")
FENCE = "```"


@dataclass(frozen=True)
class Result:
    """What the summary shows of one result file."""

    file_name: str
    title: str
    date: str
    hardware: str
    torch: str
    headline: str


def header_fields(lines: list[str]) -> dict[str, str]:
    """The header block's fields, from the lines after the title up to the first other line.

    A field may continue on lines indented by two spaces; ``Commands`` holds the lines of the
    fenced code block under it, so a ``Commands`` field without commands reads as empty.

    Example:
        >>> header_fields(["", "- Date: 2026-11-30", "- Headline: fast", "  and small", "text"])
        {'Date': '2026-11-30', 'Headline': 'fast and small'}
    """
    fields: dict[str, str] = {}
    current, in_fence = None, False
    for line in lines:
        if line.strip().startswith(FENCE):
            in_fence = not in_fence
            continue
        if in_fence:
            if current == "Commands" and line.strip():
                fields["Commands"] = (fields.get("Commands", "") + "\n" + line.strip()).strip()
            continue
        match = FIELD_LINE.fullmatch(line.rstrip())
        if match:
            current = match.group(1)
            fields[current] = match.group(2).strip() if current != "Commands" else ""
        elif line.startswith("  ") and current not in (None, "Commands"):
            fields[current] = f"{fields[current]} {line.strip()}".strip()
        elif line.strip():
            break
    return fields


def read_result(path: Path) -> Result:
    """The summary row of one result file; a ``ValueError`` names the file and what is wrong.

    Example:
        >>> read_result(FOLDER / "2026-11-30-attention-backends.md").torch
        '2.11.0+cu130'
    """
    name = FILE_NAME.fullmatch(path.name)
    if name is None:
        raise ValueError(
            f"{path}: result files are named YYYY-MM-DD-<slug>.md (lower case, digits and "
            "hyphens in the slug); rename it."
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].startswith("# "):
        raise ValueError(f"{path}: the first line must be the title, '# <what was measured>'.")
    fields = header_fields(lines[1:])
    missing = [field for field in FIELDS if not fields.get(field)]
    if missing:
        raise ValueError(
            f"{path}: the header block under the title lacks {', '.join(missing)}; add a "
            "'- Field: value' line for each (Commands: a fenced block of the exact commands), "
            "as benchmarks/README.md shows."
        )
    if fields["Date"] != name.group(1):
        raise ValueError(
            f"{path}: Date {fields['Date']!r} differs from the file name's {name.group(1)}; "
            "the file name carries the date the result was measured."
        )
    datetime.date.fromisoformat(fields["Date"])
    return Result(
        path.name,
        lines[0][2:].strip(),
        fields["Date"],
        fields["Hardware"],
        fields["torch"],
        fields["Headline"],
    )


def summary_table(folder: Path) -> str:
    """The Markdown summary of every result file in ``folder``, latest first.

    Example:
        >>> summary_table(FOLDER).splitlines()[0]
        '| Date | Result | Hardware | torch | Headline |'
    """
    results = [
        read_result(path) for path in sorted(folder.glob("*.md")) if path.name != "README.md"
    ]
    results.sort(key=lambda result: result.date, reverse=True)  # stable: by name within a date

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| Date | Result | Hardware | torch | Headline |", "| --- | --- | --- | --- | --- |"]
    rows += [
        f"| {r.date} | [{cell(r.title)}]({r.file_name}) | {cell(r.hardware)} | {cell(r.torch)} "
        f"| {cell(r.headline)} |"
        for r in results
    ]
    return "\n".join(rows)


def with_summary(readme: str, table: str) -> str:
    """``readme`` with ``table`` between the summary markers."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"benchmarks/README.md needs the lines {START!r} and then {END!r}.")
    return f"{readme[: start + len(START)]}\n\n{table}\n\n{readme[end:]}"


def main(argv: list[str] | None = None) -> int:
    """Rewrites (or with ``--check`` compares) the summary; the exit status of the command."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the summary is stale")
    parser.add_argument("--folder", type=Path, default=FOLDER, help="the benchmarks folder")
    args = parser.parse_args(argv)
    readme_path = args.folder / "README.md"
    try:
        readme = readme_path.read_text(encoding="utf-8")
        updated = with_summary(readme, summary_table(args.folder))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if updated == readme:
        print(f"{readme_path}: summary up to date")
        return 0
    if args.check:
        print(
            f"{readme_path}: summary is stale; run "
            "`uv run --locked python -m scripts.bench.benchmarks_summary` and commit the result",
            file=sys.stderr,
        )
        return 1
    readme_path.write_text(updated, encoding="utf-8")
    print(f"{readme_path}: summary written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
