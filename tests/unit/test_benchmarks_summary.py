"""scripts/bench/benchmarks_summary.py: the summary of benchmarks/README.md is current and checked.

uv run --locked pytest tests/unit/test_benchmarks_summary.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench.benchmarks_summary import END, START, main, read_result

RESULT = """# Microbenchmark: something measured

- Date: 2026-12-01
- Hardware: 1 x NVIDIA H200
- torch: 2.11.0+cu130
- Versions: Python 3.12
- Headline: 1.5x faster
- Commands:

  ```sh
  python3 -m scripts.bench.bench_dit --workload C
  ```

| a | b |
| --- | --- |
"""


def folder_with(tmp_path: Path, **results: str) -> Path:
    (tmp_path / "README.md").write_text(f"# Benchmarks\n\n{START}\n{END}\n")
    for name, text in results.items():
        (tmp_path / f"{name}.md").write_text(text)
    return tmp_path


def test_the_repository_summary_is_current(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err


def test_check_fails_until_the_summary_is_written_then_lists_the_file(tmp_path: Path):
    folder = folder_with(tmp_path, **{"2026-12-01-something": RESULT})
    assert main(["--check", "--folder", str(folder)]) == 1
    assert main(["--folder", str(folder)]) == 0
    assert main(["--check", "--folder", str(folder)]) == 0
    readme = (folder / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "2026-12-01-something.md" in line)
    assert row.split(" | ")[1:] == [
        "[Microbenchmark: something measured](2026-12-01-something.md)",
        "1 x NVIDIA H200",
        "2.11.0+cu130",
        "1.5x faster |",
    ]


@pytest.mark.parametrize("field", ["Hardware", "Headline"])
def test_a_file_missing_a_header_field_fails(tmp_path: Path, capsys, field: str):
    text = "\n".join(line for line in RESULT.splitlines() if not line.startswith(f"- {field}:"))
    folder = folder_with(tmp_path, **{"2026-12-01-something": text})
    with pytest.raises(ValueError, match=f"2026-12-01-something.md.*lacks {field}"):
        read_result(folder / "2026-12-01-something.md")
    assert main(["--check", "--folder", str(folder)]) == 2
    assert field in capsys.readouterr().err


def test_commands_without_a_command_block_count_as_missing(tmp_path: Path):
    text = RESULT.replace("  python3 -m scripts.bench.bench_dit --workload C\n", "")
    folder = folder_with(tmp_path, **{"2026-12-01-something": text})
    with pytest.raises(ValueError, match="lacks Commands"):
        read_result(folder / "2026-12-01-something.md")


def test_date_must_match_the_file_name(tmp_path: Path):
    folder = folder_with(tmp_path, **{"2026-12-02-something": RESULT})
    with pytest.raises(ValueError, match="differs from the file name"):
        read_result(folder / "2026-12-02-something.md")
