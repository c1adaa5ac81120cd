"""Helpers that are public by path: ``litegen.utils.config`` and ``litegen.utils.encode``."""
