"""Start the ranks of one node with torchrun (`torch.distributed.run`) in this process.

torch is imported inside the functions that need it, so the CLI can import this module
(and build the argument list) without paying for the torch import.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from litegen_cli.plan import derive_plan
from litegen_cli.recipe import LaunchSpec, Recipe

RESOLVED_NAME = "recipe.resolved.yaml"
WORKER_MODULE = "litegen_cli.worker"


@dataclass
class RankFailure:
    """One failed rank, as reported by torchrun."""

    rank: int
    exitcode: int
    message: str


class LaunchFailed(Exception):
    """The worker group failed; carries a short per-rank summary instead of a traceback."""

    def __init__(self, summary: str, failures: list[RankFailure] | None = None, exit_code: int = 1):
        self.summary = summary
        self.failures = list(failures or [])
        self.exit_code = exit_code
        super().__init__(summary)


def torchrun_args(spec: LaunchSpec, resolved_recipe: Path) -> list[str]:
    """Build the `torch.distributed.run` argument list for one node.

    One node uses a standalone c10d rendezvous on a free local port, so two single-node
    jobs on one machine never collide; several nodes meet at ``rdzv_endpoint``.

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
        "-m", WORKER_MODULE, str(resolved_recipe),
    ]  # fmt: skip


def write_resolved_recipe(recipe: Recipe) -> Path:
    """Write `launch:` + the validated config to ``<results_dir>/recipe.resolved.yaml``.

    The file is written to a temporary name and renamed, so a rank (or another node on a
    shared file system) never reads a half-written recipe.

    >>> write_resolved_recipe(load_recipe("recipes/digits_dit.yaml"))  # doctest: +SKIP
    PosixPath('results/digits/recipe.resolved.yaml')
    """
    results_dir = Path(recipe.config.get_results_dir())
    results_dir.mkdir(parents=True, exist_ok=True)
    target = results_dir / RESOLVED_NAME
    text = yaml.safe_dump(recipe.resolved_dict(), sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=results_dir, prefix=f".{RESOLVED_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _summarize(err: Exception) -> LaunchFailed:
    """Turn torch's ChildFailedError into per-rank lines (rank, exit code, last error)."""
    failures = []
    for rank, failure in getattr(err, "failures", {}).items():  # keyed by global rank
        message = failure.message or ""
        if isinstance(message, dict):  # @record's error file: {"message": ..., "extraInfo": ...}
            message = message.get("message", "")
        message = str(message).strip()
        if not message and failure.exitcode < 0:
            message = f"killed by signal {failure.signal_name()}"
        failures.append(RankFailure(rank, failure.exitcode, message or "no error file"))
    failures.sort(key=lambda f: f.rank)
    name = getattr(err, "name", "worker")
    return LaunchFailed(f"{len(failures)} rank(s) of {name} failed", failures)


def launch(recipe: Recipe) -> Path:
    """Validate the plan, write the resolved recipe and run torchrun for this node.

    Returns the resolved recipe path when every rank exits 0; raises LaunchFailed when a
    rank fails and RecipeError when the recipe is unusable (nothing is spawned then).

    >>> launch(load_recipe("recipes/digits_dit.yaml", ["max_steps=10"]))  # doctest: +SKIP
    """
    derive_plan(recipe)  # raises before anything is written or spawned
    resolved = write_resolved_recipe(recipe)
    args = torchrun_args(recipe.launch, resolved)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    if recipe.launch.max_restarts > 0:
        # torchrun reuses one TCPStore across restarts by default, and the restarted ranks read
        # the dead group's gloo addresses from it ("Connection refused"); a fresh store per
        # attempt avoids that. See docs/resume.md.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
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
        raise LaunchFailed(f"stopped by {name}", exit_code=128 + int(err.sigval)) from None
    return resolved
