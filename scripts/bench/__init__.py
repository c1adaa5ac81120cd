"""The benchmark suite: LiteGen against hand-written PyTorch on the in-house DiT and on real
diffusers models (speed, memory, scaling, sequence parallelism), and the summary of
benchmarks/README.md. The table of scripts and their commands: docs/performance.md#benchmarks.
"""
