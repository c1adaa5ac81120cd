"""Tools run by hand from the repository root: the benchmark suite (``scripts/bench``) and the
kernel lab (``scripts/lab``), with the timers both share (``scripts/timing.py``).

Each module runs as ``python -m scripts.<folder>.<module>`` (its docstring gives the command);
the models they train live in ``litegen_zoo``.
"""
