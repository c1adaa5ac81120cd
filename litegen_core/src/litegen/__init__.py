"""LiteGen: fast, memory-lean training for diffusion transformers.

    import litegen
    from litegen.config import MainConfig

    gen = litegen.initialize(MainConfig.load_yaml("recipe.yaml"))
    model, optimizer, loader = gen.prepare(model, optimizer, dataset)

The heavy parts (torch) load on first use, so importing ``litegen.config``
from the CLI stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litegen.config import Config, MainConfig
from litegen.utils import moved_modules

moved_modules.install()

if TYPE_CHECKING:
    from litegen.runtime.litegen import LiteGen, initialize

__all__ = ["Config", "LiteGen", "MainConfig", "initialize"]


def __getattr__(name: str) -> Any:
    if name in ("LiteGen", "initialize"):
        from litegen.runtime import litegen as _runtime

        return getattr(_runtime, name)
    raise AttributeError(f"module 'litegen' has no attribute {name!r}")
