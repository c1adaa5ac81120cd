"""Loggers, log lines, peak memory and the profiler of the training loop, on one CPU process."""

from __future__ import annotations

import io
import json
import logging
import re
import struct
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import litegen
from litegen import loggers
from litegen.instruments.metrics import MetricsLogger
from litegen.trainer import Trainer
from litegen.trainer import loop as trainer_loop
from litegen.trainer.profiling import category
from litegen.utils.config import MainConfig

PEAKS = {
    "peak_allocated_gib": 40.2,
    "peak_reserved_gib": 42.0,
    "peak_allocated_pct": 28.7,
    "peak_reserved_pct": 30.0,
}


@pytest.fixture(autouse=True)
def _own_process_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def fit(tmp_path: Path, steps: int = 2, sample_fn=None, validate_fn=None, **trainer) -> list[dict]:
    config = MainConfig.from_dict(
        {
            "runtime": {"device": "cpu"},
            "exp_name": "tiny",
            "results_dir": str(tmp_path),
            "global_batch_size": 2,
            "max_steps": steps,
            "trainer": {"log_every": 1, "save_final": False, **trainer},
        }
    )
    gen = litegen.initialize(config)
    model = nn.Linear(4, 2)
    model, optimizer, loader = gen.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [(torch.randn(4), 0) for _ in range(8)]
    )

    def train_step(batch, model):
        return model(batch[0]).square().mean()

    parts = {"model": model, "optimizer": optimizer, "loader": loader}
    Trainer(gen, train_step, parts, sample_fn=sample_fn, validate_fn=validate_fn).fit()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]


def wandb_history(run_file: Path) -> list[dict[str, str]]:
    """The history records of an offline run file (LevelDB log blocks of wandb protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buffer, out = run_file.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        buffer += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buffer)
            buffer = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                out.append({i.key or "/".join(i.nested_key): i.value_json for i in items})
    return out


def test_tensorboard_and_offline_wandb_get_the_scalars_and_the_sample_images(tmp_path, monkeypatch):
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    records = fit(
        tmp_path,
        sample_fn=lambda: torch.zeros(2, 3, 4, 4),
        sample_every=2,
        validate_fn=lambda: torch.tensor(0.25),
        validate_every=2,
        loggers=["tensorboard", "wandb"],
    )
    assert [r["step"] for r in records] == [1, 2]
    assert [r.get("val_loss") for r in records] == [None, 0.25]

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 0.25)]
    assert "train/val_loss" not in events.Tags()["scalars"]
    assert [(e.step, e.width) for e in events.Images("samples/samples")] == [(2, 14)]

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    wandb.teardown()  # the run file is complete once wandb's service has stopped
    history = wandb_history(run_file)
    logged = [(int(h["_step"]), float(h["train/loss"])) for h in history if "train/loss" in h]
    assert logged == [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert [(int(h["_step"]), float(h["val/loss"])) for h in history if "val/loss" in h] == [
        (2, 0.25)
    ]
    assert not any("train/val_loss" in h for h in history)
    assert [int(h["_step"]) for h in history if "samples/samples" in str(h)] == [2]


def test_a_logger_whose_package_is_missing_names_the_extra(monkeypatch):
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(
        loggers.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(ValueError, match=r"litegen-core\[tensorboard\].* trainer.loggers"):
        loggers.check_loggers(["jsonl", "tensorboard"])


def test_jsonl_alone_writes_no_tensorboard_even_when_installed(tmp_path):
    fit(tmp_path, steps=1)
    assert not (tmp_path / "tensorboard").exists()


def test_off_a_terminal_each_record_is_one_plain_line(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with MetricsLogger(tmp_path, total_steps=1000, enabled=True, console=console) as metrics:
        metrics.advance(119)
        metrics.log(120, loss=0.12345, samples_per_s=431.24, mfu=0.381, lr=1e-4, **PEAKS)
        metrics.advance(121)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(
        r"step 120/1000  loss 0\.1235  samples/s 431\.2  mfu 38\.1%  "
        r"mem 40\.2/42\.0 GiB \(29%\)  eta \d+:\d\d:\d\d",
        lines[0],
    ), lines[0]


def test_peak_memory_is_in_each_record_and_line_where_the_device_reports_it(
    tmp_path, monkeypatch, capsys
):
    calls = []
    monkeypatch.setattr(
        trainer_loop, "peak_memory_since_last_call", lambda device: calls.append(device) or PEAKS
    )
    records = fit(tmp_path / "cuda-like")
    assert len(calls) == len(records) == 2
    assert all(r.items() >= PEAKS.items() for r in records)
    assert "mem 40.2/42.0 GiB (29%)" in capsys.readouterr().out

    monkeypatch.undo()
    for record in fit(tmp_path / "cpu"):
        assert not any(key.startswith("peak_") for key in record)


def test_the_profiler_traces_its_steps_and_logs_a_summary(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="litegen"):
        fit(tmp_path, steps=3, profile={"start": 2, "steps": 2})
    trace = json.loads((tmp_path / "profile" / "rank_0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("step ")}
    assert steps == {"step 2", "step 3"}
    summary = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith(("profile", " "))
    ]
    assert summary[0].startswith("profile: 2 step(s), CPU operators")
    assert {line.split()[0] for line in summary[1:]} >= {"matmul", "communication", "exposed"}
    assert (
        category("ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
        category("flash_fwd_kernel"),
        category("sm90_xmma_gemm_bf16bf16_bf16f32"),
        category("Memcpy DtoH (Device -> Pinned)"),
        category("vectorized_elementwise_kernel"),
    ) == ("communication", "attention", "matmul", "copies", "elementwise/other")


def test_exposed_communication_is_what_no_other_kernel_overlaps():
    from litegen.trainer.profiling import summarize

    def kernel(name, start, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur}

    events = [
        kernel("sm90_xmma_gemm", 0, 10_000),
        kernel("ncclDevKernel_AllGather", 5_000, 10_000),  # half hidden behind the gemm
        kernel("flash_fwd_kernel", 20_000, 5_000),
    ]
    lines = summarize(events, steps=1, path="trace.json")
    rows = dict(
        re.fullmatch(r"\s+(.+?)\s+([\d.]+) ms/step\s+[\d.]+%", x).groups() for x in lines[1:]
    )
    assert lines[0].startswith("profile: 1 step(s), device kernels")
    assert rows == {
        "communication": "10.00",
        "matmul": "10.00",
        "attention": "5.00",
        "copies": "0.00",
        "elementwise/other": "0.00",
        "exposed comm.": "5.00",
    }


def test_tensorboard_shows_an_mp4_sample_as_a_gif_of_its_frames(tmp_path):
    pytest.importorskip("av")
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from litegen.loggers.tensorboard import TensorBoardSink
    from litegen.trainer import save_samples

    (mp4,) = save_samples(torch.rand(3, 3, 4, 6, 6), tmp_path / "samples")
    sink = TensorBoardSink(tmp_path / "tensorboard")
    sink.media(5, [mp4])
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("samples/samples")
    with Image.open(io.BytesIO(image.encoded_image_string)) as gif:
        assert (gif.format, gif.n_frames, gif.size) == ("GIF", 4, (18, 18))
