"""metrics.jsonl: a continued run keeps the records up to its step, a fresh run starts anew."""

import json

from litegen.instruments.metrics import MetricsLogger


def steps_in(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_continuing_from_a_step_drops_the_records_after_it(tmp_path):
    with MetricsLogger(tmp_path, total_steps=10, enabled=True) as metrics:
        for step in range(1, 6):
            metrics.log(step, loss=1.0 / step)
    with MetricsLogger(tmp_path, total_steps=10, enabled=True, start_step=3) as metrics:
        metrics.log(4, loss=0.3)
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]


def test_a_fresh_run_in_the_same_folder_starts_a_new_file(tmp_path):
    with MetricsLogger(tmp_path, total_steps=10, enabled=True) as metrics:
        metrics.log(1, loss=1.0)
    with MetricsLogger(tmp_path, total_steps=10, enabled=True) as metrics:
        metrics.log(1, loss=0.5)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 0.5)]


def test_other_ranks_write_nothing(tmp_path):
    with MetricsLogger(tmp_path, total_steps=10, enabled=False) as metrics:
        metrics.log(1, loss=1.0)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_non_finite_values_are_written_as_null_so_lines_stay_strict_json(tmp_path):
    with MetricsLogger(tmp_path, total_steps=10, enabled=True) as metrics:
        metrics.log(1, when=123.5, loss=float("nan"), grad_norm=float("inf"), lr=0.1)

    def reject(constant):
        raise ValueError(f"not strict JSON: {constant}")

    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    record = json.loads(line, parse_constant=reject)
    assert record == {"step": 1, "time": 123.5, "loss": None, "grad_norm": None, "lr": 0.1}


def test_a_record_cut_short_by_a_killed_run_is_dropped_on_resume(tmp_path):
    complete = json.dumps({"step": 1, "loss": 0.5}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(complete + '{"step": 2, "lo')
    with MetricsLogger(tmp_path, total_steps=4, enabled=True, start_step=2):
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == complete
