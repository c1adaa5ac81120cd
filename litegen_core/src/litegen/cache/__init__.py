"""Tensor artifact cache: compute latents and text embeddings once, read them every epoch.

    from litegen.cache import TensorCache, fill_cache, fingerprint

    cache = TensorCache("/data/cache", fingerprint(vae, resolution=256))
    fill_cache(cache, dataset, encode_fn, batch_size=32)  # ahead of training, on every rank
    latent = cache.get(index)["latent"]                   # during training

Keys of media files: :func:`file_key` (path, size and time, or a digest of the bytes).

See docs/data.md for the on-disk layout, concurrency and corruption handling.
"""

from litegen.cache.fill import fill_cache
from litegen.cache.fingerprint import fingerprint
from litegen.cache.keys import file_key
from litegen.cache.store import CacheStats, TensorCache

__all__ = ["CacheStats", "TensorCache", "file_key", "fill_cache", "fingerprint"]
