"""The sequence-parallel grid's longest-sequence search finds the limit with few probes."""

import pytest

from scripts.bench.bench_sp import SHAPES, THROUGHPUT_FRAMES, throughput, tokens
from scripts.bench.length_search import longest


@pytest.mark.parametrize("limit", [0, 3, 4, 5, 17, 36, 37, 63, 64, 100, 399, 400, 1000])
def test_longest_finds_the_last_fitting_multiple_of_the_step(limit):
    probes = []

    def fits(frames: int) -> bool:
        probes.append(frames)
        return frames <= limit

    found = longest(fits, start=4, step=4, limit=400)
    expected = min(limit, 400) if limit >= 400 else limit // 4 * 4
    assert found == expected
    assert len(probes) == len(set(probes)) <= 14  # no length probed twice; log-many probes


def test_throughput_is_per_gpu_after_the_warmup():
    records = [{"step": s, "tokens_per_s": 100.0 * s, "mfu": 0.1 * s} for s in range(1, 6)]
    figures = throughput(records, warmup=2, gpus=4)
    assert figures == {"tokens_per_s_per_gpu": pytest.approx(100.0), "mfu": pytest.approx(0.4)}
    assert throughput(records[:2], warmup=2, gpus=4)["tokens_per_s_per_gpu"] is None


def test_the_throughput_lengths_are_81_frames_at_480p_and_720p():
    assert tokens(THROUGHPUT_FRAMES, SHAPES["480p"]) == 32_760
    assert tokens(THROUGHPUT_FRAMES, SHAPES["720p"]) == 75_600
