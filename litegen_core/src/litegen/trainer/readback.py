"""Moved to :mod:`litegen.instruments.readback`; this import path stays, naming the same module.

Example::

    from litegen.trainer.readback import *  # the same names as litegen.instruments.readback
"""

import sys

from litegen.instruments import readback

sys.modules[__name__] = readback
