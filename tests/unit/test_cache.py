"""TensorCache: round trips, stats, fingerprints, concurrent writers, damage, budget."""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from litegen.cache import TensorCache, fill_cache, fingerprint


def assert_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # torch.equal, not torch.testing.assert_close: the latter imports torch.distributed.tensor
    # on first use, which costs seconds.
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert torch.equal(actual, expected), (actual, expected)


def value(key: int) -> dict[str, torch.Tensor]:
    # Small integers are exact in bfloat16, so stored values can be compared exactly.
    return {"latent": torch.arange(6.0).reshape(2, 3) + key, "ids": torch.tensor([key, -key])}


def shard_files(directory: Path, suffix: str) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(suffix))


def test_round_trip_dtype_and_stats(tmp_path):
    cache = TensorCache(tmp_path, "enc-1")
    assert cache.get(0) is None
    cache.put(0, value(0))
    from_buffer = cache.get(0)
    cache.flush()
    assert cache.stats.hits == 1 and cache.stats.misses == 1
    assert cache.stats.bytes_written == 6 * 2 + 2 * 8  # bf16 latent + int64 ids

    reader = TensorCache(tmp_path, "enc-1")
    got = reader.get(0)
    assert got is not None and set(got) == {"latent", "ids"}
    assert got["latent"].dtype == torch.bfloat16  # stored in the cache dtype
    assert got["ids"].dtype == torch.int64  # integers are never cast
    assert_equal(got["latent"], value(0)["latent"].bfloat16())
    assert_equal(got["ids"], value(0)["ids"])
    assert_equal(from_buffer["latent"], got["latent"])
    assert reader.stats.hits == 1 and reader.stats.bytes_read == 6 * 2 + 2 * 8
    assert reader.get("missing") is None and reader.stats.misses == 1
    assert "0" in reader and 0 in reader and len(reader) == 1


def test_dtype_none_keeps_float32_and_put_copies(tmp_path):
    cache = TensorCache(tmp_path, "enc-1", dtype=None)
    tensor = torch.randn(3)
    cache.put("a", {"x": tensor})
    tensor.zero_()  # the cache holds its own copy
    cache.flush()
    got = TensorCache(tmp_path, "enc-1").get("a")["x"]
    assert got.dtype == torch.float32 and got.abs().sum() > 0


def test_get_or_compute_calls_fn_for_misses_only(tmp_path):
    cache = TensorCache(tmp_path, "enc-1", dtype=None)
    calls: list[list] = []

    def fn(keys):
        calls.append(list(keys))
        return {"latent": torch.stack([value(k)["latent"] for k in keys])}  # batched output

    cache.put(1, value(1))
    out = cache.get_or_compute([0, 1, 2], fn)
    assert calls == [[0, 2]]
    assert [o["latent"][0, 0].item() for o in out] == [0.0, 1.0, 2.0]
    assert (cache.stats.hits, cache.stats.misses) == (1, 2)
    cache.flush()
    again = TensorCache(tmp_path, "enc-1", dtype=None).get_or_compute([2, 0], fn)
    assert calls == [[0, 2]]  # nothing recomputed
    assert_equal(again[0]["latent"], value(2)["latent"])


def test_get_or_compute_rejects_wrong_result_count(tmp_path):
    cache = TensorCache(tmp_path, "enc-1")
    with pytest.raises(ValueError, match="one dict per key"):
        cache.get_or_compute([0, 1], lambda keys: [value(0)])
    with pytest.raises(ValueError, match="2 rows"):
        cache.get_or_compute([0, 1], lambda keys: {"x": torch.zeros(3)})


def test_fingerprint_tracks_weights_and_settings(tmp_path):
    torch.manual_seed(0)
    encoder = nn.Linear(4, 2)
    fp = fingerprint(encoder, resolution=256)
    assert fp.startswith("linear-") and fp == fingerprint(encoder, resolution=256)
    assert fp != fingerprint(encoder, resolution=512)
    assert fingerprint(encoder) != fp  # settings count
    assert fingerprint(nn.Linear(4, 2), resolution=256) != fp  # other weights

    TensorCache(tmp_path, fp).put(0, value(0))
    with TensorCache(tmp_path, fp) as cache:
        cache.put(0, value(0))
    with torch.no_grad():
        encoder.weight[0, 0] += 1.0
    changed = fingerprint(encoder, resolution=256)
    assert changed != fp
    assert TensorCache(tmp_path, changed).get(0) is None  # new weights: miss, not stale
    assert TensorCache(tmp_path, fp).get(0) is not None


def test_bad_fingerprint_and_key_raise(tmp_path):
    with pytest.raises(ValueError, match="fingerprint"):
        TensorCache(tmp_path, "../escape")
    with pytest.raises(ValueError, match="cache keys"):
        TensorCache(tmp_path, "enc-1").get(1.5)


def test_budget_error_names_sizes_root_and_fix(tmp_path):
    cache = TensorCache(tmp_path, "enc-1", dtype=None, max_bytes=100)
    cache.put(0, {"x": torch.zeros(20)})  # 80 bytes
    with pytest.raises(ValueError, match="max_bytes") as err:
        cache.put(1, {"x": torch.zeros(20)})
    message = str(err.value)
    assert str(tmp_path) in message and "160 bytes" in message and "raise max_bytes" in message
    assert 1 not in cache  # rejected entries are not stored
    cache.flush()
    # The budget counts what is already on disk, seen by a fresh process too.
    with pytest.raises(ValueError, match="max_bytes"):
        TensorCache(tmp_path, "enc-1", dtype=None, max_bytes=100).put(2, {"x": torch.zeros(20)})


def _fill_worker(root: str, start: int, stop: int) -> None:
    torch.set_num_threads(1)  # as DataLoader workers do after fork
    cache = TensorCache(root, "shared", shard_bytes=64)  # tiny shards: many files per writer
    for key in range(start, stop):
        cache.get_or_compute([key], lambda keys: [value(k) for k in keys])
    cache.flush()


@pytest.mark.slow
def test_concurrent_writers_never_corrupt(tmp_path):
    # fork starts in milliseconds (the children need not import torch again); spawn elsewhere.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ranges = [(0, 30), (20, 50), (10, 40)]  # overlapping on purpose
    procs = [ctx.Process(target=_fill_worker, args=(str(tmp_path), a, b)) for a, b in ranges]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0

    directory = tmp_path / "shared"
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]
    writers = {p.name.rsplit("-", 1)[0] for p in shard_files(directory, ".json")}
    # Each process wrote only files named after itself (host-pid-random). A late starter may
    # find all of its keys already written by the others and write nothing, so 1 to 3 writers.
    writer_pids = {int(w.rsplit("-", 2)[1]) for w in writers}
    assert writer_pids and writer_pids <= {p.pid for p in procs}, (writers, [p.pid for p in procs])

    reader = TensorCache(tmp_path, "shared")
    assert reader.keys() == {str(k) for k in range(50)}
    for key in range(50):
        got = reader.get(key)
        assert_equal(got["latent"], value(key)["latent"].bfloat16())
        assert_equal(got["ids"], value(key)["ids"])
    assert reader.stats.corrupt_shards == 0


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[-1] ^= 0xFF  # last byte of the last tensor's data
        path.write_bytes(bytes(data))


# A truncated shard fails its length check when the index is read, so all its entries are
# misses; a flipped byte fails the checksum of the one tensor it hits when that entry is read
# (entries read before it were verified by their own checksums), and the shard is dropped then.
@pytest.mark.parametrize(("how", "rebuilt"), [("truncate", [0, 1, 2]), ("flip", [2])])
def test_damaged_shard_is_rebuilt_not_served(tmp_path, how, rebuilt):
    with TensorCache(tmp_path, "enc-1", dtype=None) as cache:
        for key in range(3):
            cache.put(key, value(key))
    (shard,) = shard_files(tmp_path / "enc-1", ".safetensors")
    _damage(shard, how)

    calls: list[list] = []

    def fn(keys):
        calls.append(list(keys))
        return [value(k) for k in keys]

    with pytest.warns(RuntimeWarning, match="damaged"):
        cache = TensorCache(tmp_path, "enc-1", dtype=None)
        out = cache.get_or_compute([0, 1, 2], fn)
    assert calls == [rebuilt]
    assert cache.stats.corrupt_shards == 1
    for key, tensors in enumerate(out):
        assert_equal(tensors["latent"], value(key)["latent"])
    # Once damage is found, none of the shard's entries is served by this cache again:
    # key 1 comes back only if it was rebuilt.
    assert (cache.get(1) is not None) == (1 in rebuilt)
    cache.flush()

    # A later process still finds the damaged shard on disk but serves only good entries.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        later = TensorCache(tmp_path, "enc-1", dtype=None)
        for key in range(3):
            assert_equal(later.get(key)["latent"], value(key)["latent"])
    assert later.stats.misses == 0


def test_fill_cache_splits_by_rank_and_skips_cached(tmp_path):
    dataset = [torch.full((2,), float(i)) for i in range(7)]
    seen: list[float] = []

    def encode(samples):
        seen.extend(s[0].item() for s in samples)
        return {"emb": torch.stack(samples) * 2}

    cache = TensorCache(tmp_path, "text", dtype=None)
    assert fill_cache(cache, dataset, encode, batch_size=2, rank=1, world_size=2) == 3
    assert seen == [1.0, 3.0, 5.0]
    assert fill_cache(cache, dataset, encode, batch_size=2, rank=1, world_size=2) == 0
    keys = [f"img_{i}.png" for i in range(7)]
    other = TensorCache(tmp_path, "text2", dtype=None)
    assert fill_cache(other, dataset, encode, keys=keys, batch_size=3) == 7
    assert_equal(TensorCache(tmp_path, "text2").get("img_4.png")["emb"], torch.full((2,), 8.0))
    with pytest.raises(ValueError, match="rank"):
        fill_cache(cache, dataset, encode, rank=2, world_size=2)
    with pytest.raises(ValueError, match="one key per"):
        fill_cache(cache, dataset, encode, keys=keys[:3])


def test_no_temporary_files_left(tmp_path):
    with TensorCache(tmp_path, "enc-1") as cache:
        cache.put(0, value(0))
    names = os.listdir(tmp_path / "enc-1")
    assert sorted(n.rsplit(".", 1)[1] for n in names) == ["json", "safetensors"]


def test_a_zeroed_shard_counts_as_a_hit_only_until_it_is_verified(tmp_path):
    """Same size, every byte zero: the index still lists its entries, so a fill that trusts
    the index skips them forever; verify reads them back, moves the shard aside and the fill
    encodes them again."""
    dataset = [torch.full((2,), float(i)) for i in range(4)]
    encode = lambda samples: {"emb": torch.stack(samples) * 2}  # noqa: E731
    with TensorCache(tmp_path, "text", dtype=None) as cache:
        assert fill_cache(cache, dataset, encode) == 4
    (shard,) = shard_files(tmp_path / "text", ".safetensors")
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.warns(RuntimeWarning, match="`litegen cache build` with the run's recipe"):
        trusting = TensorCache(tmp_path, "text", dtype=None)
        assert fill_cache(trusting, dataset, encode) == 0  # the index says they are there
        assert trusting.get(0) is None  # ... but they cannot be read
    with pytest.warns(RuntimeWarning, match="damaged"):
        checking = TensorCache(tmp_path, "text", dtype=None)
        assert fill_cache(checking, dataset, encode, verify=True) == 4
    assert checking.damaged == {shard.name.removesuffix(".safetensors")}
    aside = sorted(p.name for p in shard.parent.iterdir() if p.name.endswith(".damaged"))
    assert aside == [f".{shard.stem}.json.damaged", f".{shard.name}.damaged"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a later process meets no damaged shard
        later = TensorCache(tmp_path, "text", dtype=None)
        for i in range(4):
            assert_equal(later.get(i)["emb"], dataset[i] * 2)
        assert fill_cache(later, dataset, encode, verify=True) == 0


def test_file_keys_follow_the_recipe_identity_and_a_digest_sees_kept_size_and_time(tmp_path):
    import hashlib
    import os

    from litegen.cache import file_key

    media = tmp_path / "clips" / "fox.mp4"
    media.parent.mkdir()
    media.write_bytes(b"frames-1")
    stat = media.stat()
    # The identity the fine-tuning recipes hash (path|size|mtime|caption): caches stay valid.
    identity = f"clips/fox.mp4|{stat.st_size}|{stat.st_mtime_ns}|a fox"
    assert (
        file_key(media, root=tmp_path, extra="a fox")
        == hashlib.sha256(identity.encode()).hexdigest()[:24]
    )
    plain, digest = (
        file_key(media, root=tmp_path),
        file_key(media, root=tmp_path, content_digest=True),
    )
    media.write_bytes(b"frames-2")  # same size...
    os.utime(media, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and the time put back
    assert file_key(media, root=tmp_path) == plain  # the cheap key cannot tell
    assert file_key(media, root=tmp_path, content_digest=True) != digest
    latin1 = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9.png")))
    latin1.write_bytes(b"x")
    assert len(file_key(latin1, root=tmp_path, extra="caf\udce9")) == 24  # no encode error
