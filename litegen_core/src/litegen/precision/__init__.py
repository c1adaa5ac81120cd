"""Numeric precision: dtype casts, FP8 weight storage and FP8 training."""


def __getattr__(name: str):
    from litegen.utils.moved_modules import moved_attribute

    return moved_attribute(__name__, name)
