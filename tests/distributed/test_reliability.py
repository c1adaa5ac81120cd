"""A run is never lost or corrupted: real `litegen` launches with 2 gloo ranks on CPU.

- SIGKILL of the launcher leaves no rank behind (each rank has a parent-death signal);
- an entry without train_step exits 2 with one message;
- zeroed and truncated shard bytes are refused with exit 2 naming the file;
- a relaunch into a run folder changes nothing in it, and a run with a relative results_dir
  resumed from another folder continues in its own folder;
- a full disk (a small tmpfs, mounted in a user namespace) fails the run with "No space left
  on device", the folder, its free space and the last good step first, which stays `latest`;
- a rank killed by SIGKILL is named as the root failure, before the peer that saw it vanish;
- the load test: launches killed (a rank or the launcher, SIGKILL, at a random moment), each
  followed by `litegen resume`, all end with the weights of an uninterrupted run. The number
  of launches is $LITEGEN_CHAOS_RUNS (default 1; the release load test sets 20).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from litegen.checkpoint.step_dirs import find_latest
from litegen_cli.run_lock import live_holder
from tests.distributed.harness import run_ranks
from tests.distributed.test_launch import finish, litegen, read_metrics
from tests.distributed.test_resume import STEPS, assert_same_weights, run_entry_in_ranks
from tests.unit.test_run_folder import snapshot

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RESUME_ENTRY = FIXTURES / "resume_entry.py"
CHAOS_RUNS = int(os.environ.get("LITEGEN_CHAOS_RUNS", "1"))


def config_of(root: Path, **extra) -> dict:
    """The recipe's config: the uninterrupted reference uses exactly these fields."""
    return {
        "exp_name": "tiny",
        "results_dir": str(root),
        "checkpoint_dir": str(root / "ckpt"),
        "runtime": {"device": "cpu", "distributed": {"backend": "gloo", "dist_timeout": 60}},
        "max_steps": STEPS,
        "global_batch_size": 8,
        "lr": 0.01,
        "trainer": {"log_every": 1, "checkpoint_every": 2},
        **extra,
    }


def write_recipe(folder: Path, config: dict, entry: Path = RESUME_ENTRY, **launch) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    data = {"launch": {"entry": str(entry), "nproc_per_node": 2, **launch}, **config}
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """An uninterrupted run (forked ranks, no launcher): its folder and final weights."""
    root = tmp_path_factory.mktemp("reference")
    run_ranks(run_entry_in_ranks, 2, config_of(root))
    return root, torch.load(root / "ckpt" / "tiny.pth", weights_only=True)


# -- processes ----------------------------------------------------------------------------------
def ranks_of(launcher_pid: int) -> list[int]:
    """The worker processes the launcher started (its children running litegen_cli.worker)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == launcher_pid and b"litegen_cli.worker" in cmdline:
            found.append(int(proc.name))
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has stopped, only its reaping is pending


def wait_until(condition, timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def logged_steps(results: Path) -> int:
    try:
        lines = (results / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return len([line for line in lines if line.strip()])


# -- tests --------------------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigkill_of_the_launcher_leaves_no_rank_behind(tmp_path):
    root = tmp_path / "run"
    recipe = write_recipe(tmp_path, config_of(root, max_steps=100_000, step_sleep=0.05))
    proc = litegen("launch", recipe, cwd=tmp_path)
    try:
        assert wait_until(lambda: logged_steps(root) >= 1, timeout=240, every=0.2), "no step ran"
        ranks = ranks_of(proc.pid)
        assert len(ranks) == 2, ranks
        assert live_holder(root) is not None  # the launcher holds the run folder
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert wait_until(lambda: not any(alive(pid) for pid in ranks), timeout=10), (
            f"ranks {[pid for pid in ranks if alive(pid)]} outlived their launcher"
        )
        assert live_holder(root) is None  # its lock is stale now: a resume may take the folder
    finally:
        proc.kill()
        proc.communicate()


def test_an_entry_without_train_step_exits_2_before_the_ranks_start(tmp_path):
    root = tmp_path / "run"
    recipe = write_recipe(tmp_path, config_of(root), FIXTURES / "no_train_step_entry.py")
    code, out = finish(litegen("launch", recipe, cwd=tmp_path))
    assert code == 2, out[-4000:]
    text = " ".join(out.replace("│", " ").split())
    assert f"entry file '{FIXTURES / 'no_train_step_entry.py'}' does not define train_step" in text
    assert "Traceback" not in out
    assert not root.exists()  # refused before anything was written or any rank started


# Zeroed bytes stand for any damage that keeps the size (random bytes take the same digest path).
@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_damaged_shard_is_refused_with_exit_2_naming_the_file(tmp_path, reference, damage):
    run = tmp_path / "run"
    shutil.copytree(reference[0] / "ckpt", run / "ckpt")
    step = run / "ckpt" / f"step_{STEPS}"  # the newest: an older one is refused as such
    shard = sorted((step / "model_0").glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    if damage == "truncated":
        data = data[:middle]
    else:
        data[middle : middle + 4096] = bytes(4096)
    shard.write_bytes(bytes(data))
    before = snapshot(run)
    args = ["resume", "--from", step, f"launch.entry={RESUME_ENTRY}", "launch.nproc_per_node=2"]
    code, out = finish(litegen(*args, cwd=tmp_path))
    assert code == 2, out[-4000:]
    flat = out.replace("\n", "").replace("│", "").replace(" ", "")
    assert str(shard).replace(" ", "") in flat
    if damage == "truncated":  # sizes are checked before any rank starts
        assert "Cannotresume" in flat and "bytes,themanifestsays" in flat
    else:  # digests as the ranks load, before anything trains
        assert "Badinput" in flat and "doesnotmatchitsdigest" in flat
    assert not (run / "metrics.jsonl").exists()  # nothing trained
    changed = {k for k, v in snapshot(run).items() if before.get(k) != v}
    assert changed <= {".", "logs", "logs/rank_0.log", "logs/rank_1.log"}  # nothing but logs


def test_a_run_folder_is_kept_and_a_relative_one_resumes_from_anywhere(tmp_path, reference):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = {**config_of(Path("runs/tiny")), "checkpoint_dir": None, "max_steps": 4}
    recipe = write_recipe(here, config)
    code, out = finish(litegen("launch", recipe, cwd=here))
    assert code == 0, out[-4000:]
    results = here / "runs" / "tiny"
    assert [m["step"] for m in read_metrics(results)] == [1, 2, 3, 4]
    saved = yaml.safe_load((results / "step_4" / "config.yaml").read_text())
    assert saved["results_dir"] == str(results)  # stored absolute

    before = snapshot(results)
    code, out = finish(litegen("launch", recipe, cwd=here))
    assert code == 2 and "already holds another run" in out, out[-4000:]
    assert snapshot(results) == before  # not a byte, not a timestamp changed

    code, out = finish(
        litegen("resume", "--from", "../here/runs/tiny", "max_steps=6", cwd=elsewhere)
    )
    assert code == 0, out[-4000:]
    assert not (elsewhere / "runs").exists()
    assert [m["step"] for m in read_metrics(results)] == [1, 2, 3, 4, 5, 6]
    assert_same_weights(results / "tiny.pth", reference[1])


def test_killed_runs_resume_to_the_weights_of_an_uninterrupted_run(tmp_path, reference):
    """Each launch gets a SIGKILL (a rank or the launcher, at a random moment), then resume."""
    rng = random.Random(int(os.environ.get("LITEGEN_CHAOS_SEED", "0")))
    history = []
    for attempt in range(CHAOS_RUNS):
        root = tmp_path / f"run{attempt}"
        recipe = write_recipe(tmp_path / f"recipe{attempt}", config_of(root, step_sleep=0.1))
        victim = rng.choice(["launcher", "rank 0", "rank 1"])
        at_step = rng.randint(0, STEPS - 1)  # 0: while the ranks start up (import, build, load)
        jitter = rng.uniform(0, 0.3 if at_step else 2.0)
        event = f"run {attempt}: kill {victim} after step {at_step} + {jitter:.2f}s"
        proc = litegen("launch", recipe, cwd=tmp_path)
        if victim != "launcher" or at_step:  # a rank can only be killed once it runs
            wait_until(lambda: len(ranks_of(proc.pid)) == 2 or proc.poll() is not None, 240)  # noqa: B023
        wait_until(lambda: logged_steps(root) >= at_step or proc.poll() is not None, 240, 0.02)  # noqa: B023
        time.sleep(jitter)
        ranks = ranks_of(proc.pid)
        if proc.poll() is not None or (victim != "launcher" and not ranks):
            event += ": it had ended"
        elif victim == "launcher":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.kill(ranks[0 if victim == "rank 0" else -1], signal.SIGKILL)
        code, out = finish(proc)
        assert wait_until(lambda: not any(alive(pid) for pid in ranks), 10), event  # noqa: B023
        if find_latest(root / "ckpt") is not None:
            event += f", exit {code}, resume"
            code, out = finish(litegen("resume", "--from", root / "ckpt", cwd=tmp_path))
        else:
            event += f", exit {code}, no checkpoint yet: launch --overwrite"
            code, out = finish(litegen("launch", recipe, "--overwrite", cwd=tmp_path))
        history.append(event)
        assert code == 0, "\n".join([*history, out[-4000:]])
        assert_same_weights(root / "ckpt" / "tiny.pth", reference[1])
    print("\n".join(history))


def test_a_rank_killed_by_sigkill_is_named_first_then_its_peer(tmp_path):
    root = tmp_path / "run"
    # A slow monitor: torchrun then gathers both failures, the peer's recorded error included.
    config = config_of(root, kill_rank1_at_step=3)
    recipe = write_recipe(tmp_path, config, monitor_interval=3.0)
    code, out = finish(litegen("launch", recipe, cwd=tmp_path))
    assert code == 1, out[-4000:]
    lines = [" ".join(line.strip("│ ").split()) for line in out.splitlines()]
    first = lines.index(next(line for line in lines if line.startswith("rank ")))
    assert lines[first].startswith("rank 1: exit code -9: "), out[-4000:]
    assert "SIGKILL" in lines[first]
    assert lines[first + 1].startswith("then rank 0: exit code 1: "), out[-4000:]


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs user namespaces (unshare)")
def test_a_full_disk_says_so_first_with_the_free_space_and_the_last_good_step(tmp_path):
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    root = disk / "run"
    recipe = write_recipe(tmp_path, config_of(root, fill_disk_at_step=4))
    # The tmpfs lives as long as the namespace: its files are copied out before it ends.
    script = (
        f"mount -t tmpfs -o size=16m tmpfs {disk} && {sys.executable} -m litegen_cli.app "
        f"launch {recipe}; code=$?; rm -f {root}/ckpt/filler; cp -a {root} {kept}; exit $code"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    panel = out[out.index("Training failed") :].splitlines()
    head = "".join("".join(line.strip("│ ").split()) for line in panel[1:4])
    assert "rank" in panel[1] and "No space left on device" in panel[1], out[-4000:]
    assert f"into{root / 'ckpt'}failed" in head
    assert "freeof16.0MiBthere" in head
    assert f"Thelastgoodcheckpointis{root / 'ckpt' / 'step_2'}" in head
    assert (kept / "ckpt" / "latest").read_text().strip() == "step_2"
    assert (kept / "ckpt" / "step_2" / "COMPLETE").is_file()
    assert not (kept / "ckpt" / "step_4").exists()
