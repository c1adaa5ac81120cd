"""One run per folder: refusal, --overwrite, the lock (live and stale), absolute paths.

torchrun is replaced by a stub (``launcher.launch``), so these run in well under a second; the
real launches are in tests/distributed/test_reliability.py.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from litegen_cli import launcher
from litegen_cli.app import app
from litegen_cli.recipe import load_recipe
from litegen_cli.run_lock import LOCK_NAME, RunLock, live_holder

ENTRY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_entry.py"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


@pytest.fixture
def launched(monkeypatch) -> list:
    """Stands in for torchrun: records each launch, with the lock file as it was meanwhile."""
    calls = []

    def fake_launch(recipe):
        results = Path(recipe.config.get_results_dir())
        lock = results / LOCK_NAME
        calls.append((recipe, json.loads(lock.read_text()) if lock.is_file() else None))
        return results / "recipe.resolved.yaml"

    monkeypatch.setattr(launcher, "launch", fake_launch)
    return calls


def write_recipe(folder: Path, **extra) -> Path:
    data = {
        "launch": {"entry": str(ENTRY), "nproc_per_node": 2},
        "exp_name": "tiny",
        "results_dir": str(folder / "results"),
        "runtime": {"device": "cpu"},
        "max_steps": 3,
        "global_batch_size": 8,
        **extra,
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def fake_run(results: Path) -> None:
    """What a finished run leaves: metrics, two run checkpoints, latest, final weights."""
    for step in (2, 4):
        (results / f"step_{step}" / "model_0").mkdir(parents=True)
        (results / f"step_{step}" / "model_0" / "__0_0.distcp").write_bytes(os.urandom(64))
        (results / f"step_{step}" / "COMPLETE").write_text("ok\n")
    (results / "latest").write_text("step_4\n")
    (results / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    (results / "tiny.pth").write_bytes(b"weights")
    (results / "recipe.resolved.yaml").write_text("launch: {entry: x}\n")


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root (the root itself included): kind, size, mtime, contents hash."""
    entries = {".": ("dir", root.stat().st_mtime_ns)}
    for path in sorted(root.rglob("*")):
        stat = path.stat()
        if path.is_dir():
            entries[str(path.relative_to(root))] = ("dir", stat.st_mtime_ns)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            entries[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns, digest)
    return entries


def test_a_launch_into_a_folder_holding_a_run_is_refused_and_changes_nothing(tmp_path, launched):
    results = tmp_path / "results"
    fake_run(results)
    before = snapshot(results)
    result = invoke("launch", write_recipe(tmp_path))
    assert result.exit_code == 2, result.output
    out = result.output
    assert "already holds another run" in out
    assert "2 run checkpoint(s)" in out and "metrics.jsonl (2 record(s))" in out
    assert f"litegen resume --from {results}" in out
    assert "--overwrite" in out and "nothing is deleted" in out
    assert not launched
    assert snapshot(results) == before


def test_a_folder_with_only_final_weights_is_a_run_too(tmp_path, launched):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "tiny.pth").write_bytes(b"weights")
    result = invoke("launch", write_recipe(tmp_path))
    assert result.exit_code == 2 and "final weights tiny.pth" in result.output
    assert "litegen resume" not in result.output  # nothing to resume from


def test_overwrite_moves_the_earlier_run_aside(tmp_path, launched):
    results = tmp_path / "results"
    fake_run(results)
    before = snapshot(results)
    result = invoke("launch", write_recipe(tmp_path), "--overwrite")
    assert result.exit_code == 0, result.output
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("results.old-")]
    assert f"Moved the earlier run in {results} to {aside}" in result.output.replace("\n", "")
    moved = snapshot(aside)
    del moved["."], before["."]  # the lock taken while it moved touched the folder itself
    assert moved == before
    assert not (aside / LOCK_NAME).exists()
    assert [p.name for p in results.iterdir()] == []  # fresh; the lock went with the launcher
    [(_, lock)] = launched
    assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname()


def test_a_live_lock_blocks_a_launch_and_a_stale_one_does_not(tmp_path, launched):
    results = tmp_path / "results"
    with RunLock(results):  # held by this process: live
        assert live_holder(results).pid == os.getpid()
        result = invoke("launch", write_recipe(tmp_path))
        assert result.exit_code == 2, result.output
        assert "is in use by a running litegen" in result.output
        assert f"pid {os.getpid()} on {socket.gethostname()}" in result.output
    assert not launched and not (results / LOCK_NAME).exists()

    # A launcher killed with SIGKILL leaves its lock file behind, with a dead pid and no flock.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"pid": dead.pid, "host": socket.gethostname(), "started": 0.0, "command": "x"}
    (results / LOCK_NAME).write_text(json.dumps(stale))
    assert live_holder(results) is None
    result = invoke("launch", write_recipe(tmp_path))
    assert result.exit_code == 0, result.output
    assert launched[0][1]["pid"] == os.getpid()  # taken over for the run, removed after it
    assert not (results / LOCK_NAME).exists()


def newer_run(run: Path) -> None:
    """What a LoRA run of 6 steps leaves, checkpointed every 2 steps, sampled every 2 steps,
    exported at its end and once by `litegen export`."""
    files = {
        "latest": "step_6\n",
        "metrics.jsonl": "".join(f'{{"step": {i}}}\n' for i in range(1, 7)),
        "recipe.resolved.yaml": "launch: {entry: x}\n",
        "tiny.lora.safetensors": "adapters",
        "tiny.ema.lora.safetensors": "ema adapters",
        "tiny.optim_state.pth": "optimizer",
        "tiny.pth": "weights",
        "tiny_step2.pth": "weights at 2",
        "tiny_step6.pth": "weights at 6",
        "tiny.peft/adapter_config.json": "{}",
        "tiny.peft/adapter_model.safetensors": "peft adapters",
        "samples/step_2/samples.png": "png 2",
        "samples/step_4/samples.png": "png 4",
        "samples/step_6/samples.mp4": "mp4 6",
        "lora/tiny.ema.lora.safetensors": "exported adapters",
        "lora/tiny.ema.peft/adapter_config.json": "{}",
        "pipeline/transformer/diffusion_pytorch_model.safetensors": "exported weights",
        "profile/rank_0.json": "trace",
        "exports/step_6/tiny.lora.safetensors": "litegen export",
    }
    for step in (2, 4, 6):
        files[f"step_{step}/COMPLETE"] = "ok\n"
        files[f"step_{step}/model_0/__0_0.distcp"] = f"shard {step}"
    for name, text in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)


def test_move_newer_aside_keeps_every_byte_of_the_newer_run(tmp_path):
    from litegen.config import MainConfig
    from litegen_cli.run_folder import claim_run_folder

    run = tmp_path / "run"
    newer_run(run)
    before = {k: v for k, v in snapshot(run).items() if v[0] != "dir"}
    config = MainConfig(exp_name="tiny", results_dir=str(run))
    with claim_run_folder(
        config, continuing=True, resumes=run / "step_2", move_newer_aside=True
    ) as notes:
        pass
    (aside,) = tmp_path.glob("run.old-*")
    assert "With them: lora, pipeline, profile, samples/step_4, samples/step_6" in notes[0]
    after = snapshot(tmp_path)
    for name, (_, _, digest) in before.items():
        kept = after.get(f"run/{name}") or after.get(f"{aside.name}/{name}")
        assert kept and kept[2] == digest, name
    # In place: what the continued run keeps or rewrites (a copy of those is aside too);
    # everything else it would write again is aside, nothing left to overwrite.
    in_place = {name for name in before if f"run/{name}" in after}
    assert in_place == {
        "step_2/COMPLETE",
        "step_2/model_0/__0_0.distcp",
        "tiny_step2.pth",
        "samples/step_2/samples.png",
        "exports/step_6/tiny.lora.safetensors",
        "latest",
        "metrics.jsonl",
        "recipe.resolved.yaml",
    }


def test_a_lock_of_another_host_is_live_until_its_heartbeat_is_old(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    other = {"pid": 1, "host": "elsewhere-node", "started": 0.0, "command": "litegen launch"}
    (results / LOCK_NAME).write_text(json.dumps(other))
    assert live_holder(results).host == "elsewhere-node"
    old = (results / LOCK_NAME).stat().st_mtime - 3600
    os.utime(results / LOCK_NAME, (old, old))
    assert live_holder(results) is None


def test_resume_and_auto_resume_continue_in_a_folder_with_a_run(tmp_path, launched):
    fake_run(tmp_path / "results")
    result = invoke("launch", write_recipe(tmp_path, auto_resume=True))
    assert result.exit_code == 0, result.output


def test_paths_are_absolute_in_the_resolved_recipe(tmp_path, monkeypatch):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "my_entry.py").write_text(
        "def build(config): ...\ndef train_step(batch): ...\n"
    )
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path / "recipes", results_dir="out/run", init_from="w.pth")
    data = yaml.safe_load(path.read_text())
    data["launch"]["entry"] = "my_entry.py"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    assert recipe.config.results_dir == str(tmp_path / "out" / "run")
    assert recipe.config.init_from == str(tmp_path / "w.pth")
    resolved = recipe.resolved_dict()
    assert resolved["launch"]["entry"] == str(tmp_path / "recipes" / "my_entry.py")
    assert resolved["results_dir"] == str(tmp_path / "out" / "run")


@pytest.mark.parametrize("name", ["../outside", "runs/a", "..", " "])
def test_a_run_name_that_leads_out_of_the_folder_is_refused_before_anything(
    tmp_path, launched, name
):
    (tmp_path / "work").mkdir()
    recipe = write_recipe(tmp_path / "work", exp_name=name)
    before = snapshot(tmp_path)
    result = invoke("launch", recipe)
    assert result.exit_code == 2, result.output
    assert f"exp_name {name!r} cannot name a file" in result.output
    assert not launched
    assert snapshot(tmp_path) == before  # no results folder, no lock: nothing written


def test_the_library_and_export_refuse_such_names_too():
    from litegen.checkpoint.files import checkpoint_path
    from litegen.finetune.export import export_name

    with pytest.raises(ValueError, match=r"exp_name '\.\./x' cannot name a file"):
        checkpoint_path("model", default_folder="ckpt", exp_name="../x")
    with pytest.raises(ValueError, match=r"filename 'a/b\.pth' cannot name a file"):
        checkpoint_path("model", default_folder="ckpt", exp_name="x", filename="a/b.pth")
    with pytest.raises(ValueError, match=r"exp_name '/etc/x' cannot name a file"):
        export_name("/etc/x", ema=True)
    assert export_name("my.run-2", ema=True) == "my.run-2.ema"


def test_a_failed_validation_writes_nothing(tmp_path, launched):
    result = invoke("launch", write_recipe(tmp_path), "max_step=4")
    assert result.exit_code == 2
    assert not (tmp_path / "results").exists()


def test_the_cli_spells_no_run_folder_name():
    # litegen.checkpoint.layout declares them; a copy here would drift from the core's.
    names = {"step_*", "latest", "COMPLETE", "MANIFEST.json", "metrics.jsonl", "launch.yaml"}
    cli = Path(__file__).resolve().parents[2] / "litegen_cli" / "src" / "litegen_cli"
    spelled = [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for path in sorted(cli.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value in names or node.value.endswith("*.pth"))
    ]
    assert not spelled, spelled
