"""The spec's import path for LiteGen's configuration: everything in :mod:`litegen.config`.

from litegen.utils.config import MainConfig

config = MainConfig.load_yaml("recipe.yaml")
"""

from litegen.config import *  # noqa: F403
from litegen.config import __all__  # noqa: F401
