"""One message per failure: ranks' exit codes, the root failure, and ranks that outlive no
launcher (a parent-death signal, or a watchdog where there is none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from litegen.entry import load_entry
from litegen_cli.failures import (
    RankFailure,
    exit_code_for,
    rank_failure,
    record_failure,
    root_failure,
)
from litegen_cli.launcher import _summarize


def raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as err:
        return err
    raise AssertionError("no error")


def test_bad_input_found_by_litegen_exits_2_and_other_errors_1():
    missing = raised(lambda: load_entry("/nowhere/entry.py"))
    assert isinstance(missing, ValueError) and exit_code_for(missing) == 2

    def users_bug():
        raise ValueError("a ValueError in the user's own code is a failed run")

    assert exit_code_for(raised(users_bug)) == 1
    assert exit_code_for(RuntimeError("boom")) == 1
    assert exit_code_for(KeyboardInterrupt()) == 130
    assert exit_code_for(SystemExit(0)) == 0 and exit_code_for(SystemExit("bye")) == 1


def test_a_rank_records_one_message_and_logs_its_traceback(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    err = raised(lambda: load_entry("/nowhere/entry.py"))
    assert record_failure(err, 3, tmp_path / "results") == 2
    record = json.loads(error_file.read_text())["message"]
    assert record["message"].startswith("ValueError: launch.entry: entry module file /nowhere")
    info = record["extraInfo"]["litegen"]
    assert info["exit_code"] == 2 and info["log"] == str(tmp_path / "results/logs/rank_3.log")
    assert "Traceback" in Path(info["log"]).read_text()

    # The launcher's side: the recorded failure is the root one, whatever the rank order.
    failures = {
        0: SimpleNamespace(message="", exitcode=-15, signal_name=lambda: "SIGTERM"),
        3: SimpleNamespace(message=record, exitcode=2),
    }
    summary = _summarize(SimpleNamespace(name="litegen_cli.worker", failures=failures))
    assert summary.exit_code == 2
    assert [f.rank for f in summary.failures] == [3, 0]
    assert summary.failures[1].message == "killed by signal SIGTERM"


WRITE_A_LONG_FAILURE = """
from litegen_cli.failures import record_failure
record_failure(RuntimeError("x" * 20_000_000), 1, None)
"""


def test_a_rank_killed_while_recording_leaves_no_error_file_torchrun_cannot_parse(tmp_path):
    # torchrun parses every rank's error file and crashes on a half-written one, so a rank it
    # kills mid-write must leave a whole file or none.
    folder = tmp_path / "torchelastic"
    folder.mkdir()
    error_file = folder / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    child = subprocess.Popen([sys.executable, "-c", WRITE_A_LONG_FAILURE], env=env)
    deadline = time.monotonic() + 120
    while not any(folder.iterdir()) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    child.kill()
    child.wait()
    assert any(folder.iterdir()), "the rank wrote nothing before it ended"
    if error_file.exists():
        json.loads(error_file.read_text(encoding="utf-8"))


def test_the_root_failure_is_the_earliest_recorded_one():
    late, early = RankFailure(0, 1, "gloo: peer gone", 20.0), RankFailure(1, 2, "bad", 10.0)
    assert root_failure([late, early]) is early
    unrecorded = [RankFailure(2, -15, "stopped"), RankFailure(1, -15, "stopped")]
    assert root_failure(unrecorded).rank == 1


def test_a_rank_killed_from_outside_is_the_root_not_the_peer_that_saw_it_vanish():
    peer = RankFailure(0, 1, "RuntimeError: [gloo] Connection closed by peer", 10.0)
    killed = RankFailure(1, -9, "killed by signal SIGKILL")
    assert killed.signal == "SIGKILL" and peer.signal is None
    assert root_failure([peer, killed]) is killed
    # SIGTERM and SIGABRT may be the aftermath of another rank's failure: the recorded one wins.
    assert root_failure([peer, RankFailure(1, -6, "killed by signal SIGABRT")]) is peer
    plain = SimpleNamespace(message={"message": "ValueError: bad"}, exitcode=1)
    assert rank_failure(1, plain) == RankFailure(1, 1, "ValueError: bad")


CHILD = """
import sys, time
import litegen_cli.lifeline as lifeline
if sys.argv[1] == "watchdog":
    lifeline._parent_death_signal = lambda sig: False
lifeline.POLL_S = 0.05
print(lifeline.die_with_launcher(), flush=True)
time.sleep(60)
"""
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
"""  # the parent exits right away: its child must follow


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie has stopped; only its parent may not have reaped it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["prctl", "watchdog"])
def test_a_rank_stops_when_its_launcher_dies(how):
    out = subprocess.run(
        [sys.executable, "-c", PARENT, textwrap.dedent(CHILD), how],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    pid, armed = int(out[0]), out[1]
    assert armed == how
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid), f"pid {pid} outlived its launcher"


def test_a_rank_whose_launcher_is_already_gone_stops_at_once():
    env = {**os.environ, "LITEGEN_LAUNCHER_PID": "1"}  # never this process's parent
    code = "from litegen_cli.lifeline import die_with_launcher; die_with_launcher(); print('ran')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "ran" not in done.stdout
    assert "the launcher (pid 1) is gone" in done.stderr
