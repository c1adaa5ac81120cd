"""FLOP accounting: counting a step's FLOPs (:mod:`.counting`) and the throughput and MFU
built on them (:mod:`.throughput`)."""


def __getattr__(name: str):
    from litegen.utils.moved_modules import moved_attribute

    return moved_attribute(__name__, name)
