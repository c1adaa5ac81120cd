"""Run one recipe through ``litegen launch`` and through ``hand_loop.py``, and compare samples/s.

Each side runs in its own process, sides alternating, ``rounds`` times each, so that drift of
the machine (clocks, other jobs) reaches both. A side's rate is the median samples/s of its
windows of ``window`` steps inside the steps ``(first, last]`` (warm-up and the last steps
excluded), read from the ``metrics.jsonl`` each side writes; the best round of each side is
kept. Used by ``bench_launch.py`` and ``tests/distributed/test_launch_speed.py``.

    python -m scripts.bench.launch_vs_hand RECIPE.yaml --first 20 --last 200 --window 20 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HAND_LOOP = Path(__file__).resolve().parent / "hand_loop.py"
SIDES = ("hand", "launch")


@dataclass
class SideResult:
    """The rounds of one side: samples/s of each, and what each side's summary.json said."""

    rates: list[float] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def best(self) -> float:
        return max(self.rates)


def side_command(side: str, recipe: Path, overrides: list[str]) -> list[str]:
    """The command line that runs ``recipe`` on ``side``; both take the same overrides."""
    if side == "launch":
        return [sys.executable, "-m", "litegen_cli.app", "launch", str(recipe), *overrides]
    return [sys.executable, str(HAND_LOOP), str(recipe), *overrides]


def run_side(
    side: str,
    recipe: Path,
    results: Path,
    overrides: list[str] = (),
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run one side to completion; returns its metrics records and summary (may be empty)."""
    command = side_command(side, recipe, [*overrides, f"results_dir={results}"])
    proc = subprocess.run(
        command,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{side} side failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    lines = (results / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    summary_file = results / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    logged = [r["peak_allocated_gib"] for r in records if r.get("peak_allocated_gib") is not None]
    if logged:  # the trainer resets the peak at every log: the run's peak is the largest logged
        summary["peak_memory_gib"] = max([*logged, summary.get("peak_memory_gib") or 0.0])
    return records, summary


def window_rates(records: list[dict[str, Any]], first: int, last: int, window: int) -> list[float]:
    """samples/s of each ``window``-step window in ``(first, last]``, from a run's records.

    A record holds the rate of the steps since the previous record (the trainer's
    ``samples_per_s``); windows are aligned to multiples of ``window`` and must consist of
    whole records, so the launch side's log windows and the hand side's per-step records can
    be cut into the same windows.
    """
    seconds: dict[int, float] = {}  # window end -> seconds, summed over its records
    steps: dict[int, int] = {}
    previous = 0
    for record in sorted(records, key=lambda r: r["step"]):
        step, rate = record["step"], record.get("samples_per_s")
        if rate and first <= previous and step <= last:
            end = -(-step // window) * window
            if end == -(-(previous + 1) // window) * window:  # the record lies in one window
                count = step - previous
                seconds[end] = seconds.get(end, 0.0) + count / rate
                steps[end] = steps.get(end, 0) + count
        previous = step
    return [steps[end] / seconds[end] for end in sorted(seconds) if steps[end] == window]


def compare(
    recipe: Path,
    work: Path,
    *,
    first: int,
    last: int,
    window: int,
    rounds: int,
    overrides: list[str] = (),
    side_overrides: dict[str, list[str]] | None = None,
    env: dict[str, str] | None = None,
    sides: tuple[str, ...] = SIDES,
) -> dict[str, SideResult]:
    """Alternate the sides ``rounds`` times, each round in its own folder under ``work``.

    ``overrides`` apply to both sides, ``side_overrides[side]`` to one (say, its log cadence);
    ``sides`` may leave one out (an ablation of launch settings, say).
    """
    results = {side: SideResult() for side in sides}
    for round_ in range(rounds):
        order = sides if round_ % 2 == 0 else sides[::-1]
        for side in order:
            folder = work / f"{side}_{round_}"
            extra = (side_overrides or {}).get(side, [])
            records, summary = run_side(side, recipe, folder, [*overrides, *extra], env=env)
            rates = window_rates(records, first, last, window)
            if not rates:
                raise RuntimeError(
                    f"{side} side logged no whole {window}-step window in steps ({first}, {last}]"
                )
            results[side].rates.append(statistics.median(rates))
            results[side].summaries.append(summary)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for both sides")
    parser.add_argument("--work", type=Path, default=Path("results/launch_vs_hand"))
    parser.add_argument("--first", type=int, default=20, help="warm-up steps left out")
    parser.add_argument("--last", type=int, default=200)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = compare(
        args.recipe,
        args.work,
        first=args.first,
        last=args.last,
        window=args.window,
        rounds=args.rounds,
        overrides=args.overrides,
        env={"OMP_NUM_THREADS": "1"},
    )
    for side, result in results.items():
        print(f"{side:>6}: " + "  ".join(f"{r:9.1f}" for r in result.rates) + "  samples/s")
    print(f"launch / hand (best rounds): {results['launch'].best / results['hand'].best:.3f}")


if __name__ == "__main__":
    main()
