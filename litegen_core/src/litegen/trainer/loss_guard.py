"""Moved to :mod:`litegen.instruments.loss_guard`; this import path stays, naming the same module.

Example::

    from litegen.trainer.loss_guard import *  # the same names as litegen.instruments.loss_guard
"""

import sys

from litegen.instruments import loss_guard

sys.modules[__name__] = loss_guard
