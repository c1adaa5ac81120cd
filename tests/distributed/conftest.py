"""Distributed tests run ranks through ``harness.run_ranks``; make it importable by name."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
