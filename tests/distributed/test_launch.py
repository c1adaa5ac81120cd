"""`litegen launch` end to end: real torchrun, 2 gloo ranks on CPU, one or two "nodes"."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TIMEOUT_S = 300  # two CPU ranks importing torch take a while on small CI machines


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_recipe(tmp_path: Path, entry: str, launch: dict | None = None, **extra) -> Path:
    data = {
        "launch": {"entry": str(FIXTURES / entry), "nproc_per_node": 2, **(launch or {})},
        "exp_name": "tiny",
        "results_dir": str(tmp_path / "results"),
        "runtime": {"device": "cpu", "distributed": {"backend": "gloo", "dist_timeout": 120}},
        "max_steps": 4,
        "global_batch_size": 8,
        "lr": 0.01,
        "trainer": {"log_every": 1, "save_final": False},
        **extra,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def litegen(*args: str | Path, cwd: Path, omp_threads: bool = True) -> subprocess.Popen:
    """Start `litegen ...` as its own process, as a user (or srun) would; without
    ``omp_threads``, OMP_NUM_THREADS unset (torchrun then sets it, with a banner)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMP_NUM"))}
    env.update(COLUMNS="200", **({"OMP_NUM_THREADS": "1"} if omp_threads else {}))
    return subprocess.Popen(
        [sys.executable, "-m", "litegen_cli.app", *map(str, args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"litegen launch did not finish in {TIMEOUT_S}s:\n{out[-4000:]}")
    return proc.returncode, out


def read_metrics(results: Path) -> list[dict]:
    return [json.loads(line) for line in (results / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_launch_writes_metrics(tmp_path):
    recipe = write_recipe(tmp_path, "tiny_entry.py")
    hooks = ("trainer.sample_every=2", "trainer.validate_every=3")
    code, out = finish(litegen("launch", recipe, "max_steps=3", *hooks, cwd=tmp_path))
    assert code == 0, out[-4000:]
    results = tmp_path / "results"
    assert (results / "recipe.resolved.yaml").is_file()
    metrics = read_metrics(results)
    assert len(metrics) == 3  # log_every=1: one line per step, the override applied
    assert all("loss" in m for m in metrics)
    assert [("val_loss" in m) for m in metrics] == [False, False, True]
    assert [p.name for p in (results / "samples").iterdir()] == ["step_2"]
    assert (results / "samples" / "step_2" / "samples.png").is_file()
    # Output to a pipe: one plain line per logged step, no progress bar.
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], out[-4000:]
    assert all(" loss " in line and " eta " in line for line in lines)


def test_two_nodes_on_one_machine(tmp_path):
    """nnodes=2 with one rank each, meeting at a c10d rendezvous on localhost."""
    launch = {
        "nproc_per_node": 1,
        "nnodes": 2,
        "rdzv_endpoint": f"localhost:{free_port()}",
        "rdzv_id": f"test-{uuid.uuid4().hex[:8]}",
    }
    recipe = write_recipe(tmp_path, "tiny_entry.py", launch=launch)
    nodes = [litegen("launch", recipe, f"launch.node_rank={r}", cwd=tmp_path) for r in (0, 1)]
    results = [finish(node) for node in nodes]
    for code, out in results:
        assert code == 0, out[-4000:]
    assert len(read_metrics(tmp_path / "results")) == 4


def test_failing_worker_exits_1_with_short_message(tmp_path):
    recipe = write_recipe(tmp_path, "failing_entry.py", max_steps=1)
    code, out = finish(litegen("launch", recipe, cwd=tmp_path))
    assert code == 1, out[-4000:]
    assert "Training failed" in out
    assert "exit code 1: RuntimeError: boom from the failing fixture" in out
    # The launcher's own torch traceback (ChildFailedError) is replaced by the summary.
    assert "ChildFailedError" not in out


def test_the_console_shows_each_event_once_and_no_library_notices(tmp_path):
    """Each rank raises the same warnings (tests/fixtures/noisy_entry.py): the console shows
    rank 0's once (a library's log warning, a plain Python warning, LiteGen's deprecated-field
    warning and log warning), rank 1's go to its log file, and neither shows a library's
    deprecation notice or advisory line; no line twice, and no torchrun banner."""
    sys.path.insert(0, str(FIXTURES))
    try:
        from noisy_entry import EVENTS
    finally:
        sys.path.remove(str(FIXTURES))
    recipe = write_recipe(tmp_path, "noisy_entry.py")
    code, out = finish(litegen("launch", recipe, cwd=tmp_path, omp_threads=False))
    assert code == 0, out[-4000:]
    console = " ".join(out.split())  # rich wraps long lines
    counts = {name: console.count(text) for name, text in EVENTS.items()}
    shown = {"library_log": 1, "plain": 1, "litegen_field": 1, "litegen_log": 1}
    assert counts == {"library_notice": 0, "advice": 0, **shown}, out
    assert "[rank 0] " + EVENTS["litegen_log"] in console
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    assert len(lines) == len(set(lines)), out
    assert "OMP_NUM_THREADS" not in out and "step 4/4" in out
    rank_1 = (tmp_path / "results" / "logs" / "rank_1.log").read_text()
    assert "[rank 1] " + EVENTS["litegen_log"] in rank_1
    for name in ("plain", "litegen_field"):
        assert rank_1.count(EVENTS[name]) == 1, rank_1
    assert EVENTS["library_notice"] not in rank_1 and EVENTS["advice"] not in rank_1
