"""metrics.jsonl stays strict JSON: a NaN or inf value is written as null, never as NaN."""

import json
import math

import pytest

from litegen.metrics import MetricsLogger


def strict(line: str) -> dict:
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.xfail(reason="metrics rewrite pending", strict=True)
def test_non_finite_values_are_written_as_null(tmp_path):
    with MetricsLogger(tmp_path, total_steps=2, enabled=True) as metrics:
        metrics.log(1, loss=math.nan, grad_norm=math.inf)
        metrics.log(2, loss=0.5, grad_norm=-math.inf)
    records = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["loss"], r["grad_norm"]) for r in records] == [(None, None), (0.5, None)]
