"""Start the ranks of one node with torchrun (`torch.distributed.run`) in this process.

torch is imported inside the functions that need it, so the CLI can import this module
(and build the argument list) without paying for the torch import.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from litegen.checkpoint.atomic import atomic_write_text
from litegen.checkpoint.layout import RESOLVED_RECIPE
from litegen.config import MainConfig
from litegen_cli.failures import (
    EXIT_BAD_INPUT,
    LaunchFailed,
    RankFailure,
    launcher_exit_code,
    rank_failure,
    root_failure,
)
from litegen_cli.lifeline import LAUNCHER_PID_ENV
from litegen_cli.recipe import LaunchSpec, Recipe
from litegen_cli.run_shape import derive_run_shape

RESOLVED_NAME = RESOLVED_RECIPE
WORKER_MODULE = "litegen_cli.worker"
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# Offload frees each block's saved tensors as their copies finish and brings them back during
# backward, between the compute's own large allocations; the caching allocator's fixed-size
# segments fragment under that pattern (docs/memory.md), growable ones do not.
OFFLOAD_ALLOCATOR_CONF = "expandable_segments:True"

__all__ = [
    "LaunchFailed",
    "RankFailure",
    "allocator_conf",
    "launch",
    "run_ranks",
    "torchrun_args",
    "write_resolved_recipe",
]


def torchrun_args(
    spec: LaunchSpec, resolved_recipe: Path, worker_args: Sequence[str] = ()
) -> list[str]:
    """Build the `torch.distributed.run` argument list for one node.

    One node uses a standalone c10d rendezvous on a free local port, so two single-node
    jobs on one machine never collide; several nodes meet at ``rdzv_endpoint``.
    ``worker_args`` follow the resolved recipe on the worker's command line (its mode).

    >>> spec = LaunchSpec(entry="m", nnodes=2, node_rank=1, rdzv_endpoint="n1:29500")
    >>> torchrun_args(spec, Path("r.yaml"))[:4]
    ['--nnodes', '2', '--node_rank', '1']
    """
    if spec.nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [
            "--nnodes", str(spec.nnodes),
            "--node_rank", str(spec.node_rank),
            "--rdzv_backend", spec.rdzv_backend,
            "--rdzv_endpoint", spec.rdzv_endpoint,
            "--rdzv_id", spec.rdzv_id,
        ]  # fmt: skip
    return [
        *rendezvous,
        "--nproc_per_node", str(spec.nproc_per_node),
        "--max_restarts", str(spec.max_restarts),
        "--monitor_interval", str(spec.monitor_interval),
        "-m", WORKER_MODULE, str(resolved_recipe), *worker_args,
    ]  # fmt: skip


def write_resolved_recipe(
    recipe: Recipe, folder: Path | None = None, name: str = RESOLVED_NAME
) -> Path:
    """Write `launch:` + the validated config to ``<results_dir>/recipe.resolved.yaml``.

    The file is written to a temporary name and renamed, so a rank (or another node on a
    shared file system) never reads a half-written recipe. ``folder`` replaces the results dir
    (nodes other than node 0 write theirs to a private folder: node 0 owns the run folder).

    Example:
        >>> from litegen_cli.recipe import load_recipe
        >>> _ = Path("entry.py").write_text("def build(config): ...\\ndef train_step(batch): ...\\n")
        >>> _ = Path("recipe.yaml").write_text("launch: {entry: entry.py}\\nglobal_batch_size: 8\\n")
        >>> write_resolved_recipe(load_recipe("recipe.yaml"))
        PosixPath('.../results/default_exp/recipe.resolved.yaml')
    """
    results_dir = Path(folder or recipe.config.get_results_dir())
    results_dir.mkdir(parents=True, exist_ok=True)
    target = results_dir / name
    text = yaml.safe_dump(recipe.resolved_dict(), sort_keys=False)
    return atomic_write_text(target, text)


def _summarize(err: Exception) -> LaunchFailed:
    """Turn torch's ChildFailedError into the root failure first, then the other ranks."""
    failures = [rank_failure(rank, f) for rank, f in getattr(err, "failures", {}).items()]
    if not failures:
        return LaunchFailed("the worker group failed without a rank failure")
    root = root_failure(failures)
    others = sorted((f for f in failures if f is not root), key=lambda f: f.rank)
    name = getattr(err, "name", "worker")
    return LaunchFailed(
        f"{len(failures)} rank(s) of {name} failed", [root, *others], launcher_exit_code(root)
    )


def _quiet_torchrun() -> None:
    """torchrun's agent logs every failure and every rank it stops, and its launcher a banner
    on OMP_NUM_THREADS (which it then sets to 1); the CLI says what matters once."""
    quiet = ("torch.distributed.elastic", "torch.distributed.run")
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith(quiet) and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def launch(recipe: Recipe) -> Path:
    """Validate the plan, write the resolved recipe and run torchrun for this node.

    Returns the resolved recipe path when every rank exits 0; raises LaunchFailed when a
    rank fails and RecipeError when the recipe is unusable (nothing is spawned then).

    Example::

        launch(load_recipe("recipes/digits_dit.yaml", ["max_steps=10"]))
    """
    derive_run_shape(recipe)  # raises before anything is written or spawned
    results = Path(recipe.config.get_results_dir())
    if recipe.launch.node_rank != 0:  # node 0 owns the run folder and its resolved recipe
        private = Path(tempfile.mkdtemp(prefix=f"litegen-node{recipe.launch.node_rank}-"))
        try:
            run_ranks(recipe, write_resolved_recipe(recipe, private))
        finally:
            shutil.rmtree(private, ignore_errors=True)
        return results / RESOLVED_NAME
    # The ranks read a pending copy; it becomes recipe.resolved.yaml once they ran, so a launch
    # refused as bad input (a damaged checkpoint found by the ranks) leaves the earlier one.
    for leftover in results.glob(f".{RESOLVED_NAME}.*.pending"):  # of a launcher killed before
        leftover.unlink(missing_ok=True)
    pending = write_resolved_recipe(recipe, name=f".{RESOLVED_NAME}.{os.getpid()}.pending")
    keep = True
    try:
        run_ranks(recipe, pending)
    except LaunchFailed as err:
        keep = err.exit_code != EXIT_BAD_INPUT
        raise
    finally:
        if keep:
            os.replace(pending, results / RESOLVED_NAME)
        else:
            pending.unlink(missing_ok=True)
    return results / RESOLVED_NAME


def allocator_conf(config: MainConfig) -> str | None:
    """The CUDA allocator setting the ranks get unless ``PYTORCH_CUDA_ALLOC_CONF`` is set.

    Growable segments where activation offload is on (in the general settings or a profile);
    ``None`` (torch's default) otherwise.

    >>> allocator_conf(MainConfig.from_dict({"optimization": {"memory": {"activation_offload": True}}}))
    'expandable_segments:True'
    """
    opt = config.optimization
    settings = [opt, *(opt.resolve(name) for name in opt.profiles)]
    return OFFLOAD_ALLOCATOR_CONF if any(s.memory.activation_offload for s in settings) else None


def run_ranks(recipe: Recipe, resolved: Path, worker_args: Sequence[str] = ()) -> None:
    """Run torchrun for this node: ``recipe.launch`` ranks, each ``litegen_cli.worker resolved
    *worker_args``; returns when every rank exited 0, raises LaunchFailed otherwise.

    The one way ranks are started: ``launch`` trains through it, ``cache build`` fills a cache.

    Example::

        run_ranks(recipe, write_resolved_recipe(recipe))
    """
    args = torchrun_args(recipe.launch, resolved, worker_args)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    _quiet_torchrun()
    # Each rank stops when this process dies, even by SIGKILL (lifeline.py).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if recipe.launch.max_restarts > 0:
        # torchrun reuses one TCPStore across restarts by default, and the restarted ranks read
        # the dead group's gloo addresses from it ("Connection refused"); a fresh store per
        # attempt avoids that. See docs/resume.md.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    conf = allocator_conf(recipe.config)
    if conf is not None:  # read by each rank's CUDA allocator at its first allocation
        os.environ.setdefault(ALLOCATOR_ENV, conf)
    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as err:
        raise _summarize(err) from None
    except RendezvousError as err:
        # e.g. the other nodes never joined: say where this node waited.
        where = f"{recipe.launch.rdzv_endpoint} (rdzv_id {recipe.launch.rdzv_id})"
        raise LaunchFailed(f"rendezvous at {where} failed: {type(err).__name__}: {err}") from None
    except SignalException as err:
        # Ctrl-C / scancel: torchrun already stopped the ranks; exit as a shell would.
        name = err.sigval.name
        raise LaunchFailed(
            f"stopped by {name}", exit_code=128 + int(err.sigval), signal=name
        ) from None
