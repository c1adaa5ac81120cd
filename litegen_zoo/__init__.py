"""The model zoo of the tests and the benchmarks: real diffusers transformers at published or
tiny sizes with synthetic batches, an in-house DiT, entry modules and tiny pipeline folders.

Plain PyTorch and diffusers; LiteGen is what they are trained with, never what they import.
Importable from anywhere in the uv environment (the workspace root installs it) and, on a GPU
node without uv, with the repository root on ``PYTHONPATH``:

    from litegen_zoo.real_models import REAL_MODELS
    from litegen_zoo.dit_model import DiT, DiTConfig
"""
