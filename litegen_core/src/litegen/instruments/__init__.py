"""The training loop's instruments: ``metrics`` (metrics.jsonl, the loggers and the progress
display), ``readback`` (logged values reaching the host without a sync) and ``loss_guard`` (the
non-finite loss check). The loop uses them; they know nothing of it.

Example::

    from litegen.instruments.metrics import MetricsLogger
"""
