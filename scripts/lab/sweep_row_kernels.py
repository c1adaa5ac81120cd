"""Time inductor's LayerNorm kernels, forward and backward, over a grid of launch configs.

Where ``litegen.experimental.row_reductions.row_launch_config`` comes from. First compile a run
into an inductor cache of its own, with kernel benchmarks on, so that every generated kernel
file can build its own inputs; then sweep the LayerNorm kernels found there (one GPU):

    export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TORCHINDUCTOR_BENCHMARK_KERNEL=1
    torchrun --nproc_per_node=1 -m scripts.bench.bench_dit --workload C --strategy ddp --compile \
        --steps 5 --warmup 2 --set optimization.experimental.persistent_rows=2048 ...
    python3 -m scripts.lab.sweep_row_kernels /tmp/ind --out sweep --seconds 240 [--match backward]

For each kernel it prints the time of the config inductor launches (its autotuned or fixed
one), then every config of the grid, fastest first: rows a program x warps, and for looped
(two-pass) kernels also the elements a loop step reads (``R0_BLOCK``). ``--out`` keeps the
kernels' sources and the times as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
import shutil
import time
from functools import partial
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

# Kernels with a LayerNorm (or its backward) in them: persistent ("per"), looped ("red"), and
# "unk", inductor's name for kernels with a fixed launch config, which LiteGen's rows get.
KERNEL = re.compile(r"def (triton_(?:per|red|unk)_fused\w*layer_norm\w*)\(")
ROWS_GRID = [1, 2, 4, 8, 16]  # rows a program
WARPS = [2, 4, 8, 16]
LOOP_STEPS = [256, 512, 1024, 2048]  # R0_BLOCK of looped kernels


def row_kernels(cache: Path) -> list[tuple[Path, str]]:
    """The LayerNorm kernel files of an inductor cache, each with its kernel's name.

    Example:
        >>> row_kernels(Path("/tmp/ind"))  # doctest: +SKIP
        [(PosixPath('/tmp/ind/ab/cab....py'), 'triton_unk_fused_native_layer_norm_0')]
    """
    found = []
    for path in sorted(cache.rglob("*.py")):
        source = path.read_text()
        kernel = KERNEL.search(source)
        # Kernel files only: graph modules hold kernels too, but run the whole graph.
        if kernel and "def get_args()" in source and "async_compile" not in source:
            found.append((path, kernel.group(1)))
    return found


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"kernel_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(path: Path, name: str, deadline: float) -> dict:
    module = load(path)
    args = module.get_args()
    fn = getattr(module, name).fn  # the @triton.jit function under inductor's launcher
    names = [a for i, a in enumerate(fn.arg_names) if i not in fn.constexprs]
    xnumel = args[names.index("xnumel")]
    inductor_us = 1000 * do_bench(lambda: module.call(args), warmup=25, rep=100)
    print(f"\n{name}: {xnumel} rows; inductor's launch {inductor_us:.1f} us", flush=True)
    # A persistent kernel holds its whole row; a looped one reads R0_BLOCK elements a step.
    looped = "R0_BLOCK" in fn.arg_names
    timed = []
    for rows, warps, step in itertools.product(ROWS_GRID, WARPS, LOOP_STEPS if looped else [2048]):
        if warps * 32 > rows * step or time.time() > deadline:
            continue
        launch = {"XBLOCK": rows, "num_warps": warps, "num_stages": 1}
        if looped:
            launch["R0_BLOCK"] = step
        kernel = fn[(triton.cdiv(xnumel, rows),)]
        us = 1000 * do_bench(partial(kernel, *args, **launch), warmup=10, rep=50)
        timed.append((us, launch))
    timed.sort(key=lambda row: row[0])
    for us, launch in timed:
        print(f"  {us:8.1f} us  {launch}")
    return {"name": name, "inductor_us": inductor_us, "sweep": timed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache", type=Path, help="the run's TORCHINDUCTOR_CACHE_DIR")
    p.add_argument("--out", type=Path, help="copy the kernels and write sweep.json here")
    p.add_argument("--seconds", type=float, default=240, help="stop timing new configs after")
    p.add_argument("--match", default="", help="sweep only kernels whose name has this regex")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    deadline = time.time() + args.seconds
    results = []
    for path, name in row_kernels(args.cache):
        if not re.search(args.match, name):
            continue
        results.append(sweep(path, name, deadline))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, args.out / f"{name}.py")
    if args.out:
        (args.out / "sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
