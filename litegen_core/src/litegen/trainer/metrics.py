"""Moved to :mod:`litegen.instruments.metrics`; this import path stays, naming the same module.

Example::

    from litegen.trainer.metrics import *  # the same names as litegen.instruments.metrics
"""

import sys

from litegen.instruments import metrics

sys.modules[__name__] = metrics
