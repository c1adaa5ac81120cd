"""Per-rank entry started by torchrun: ``python -m litegen_cli.worker RESOLVED_RECIPE``.

``@record`` writes this rank's exception to torchrun's error file, so the launcher can
show a one-line reason per failed rank instead of every rank's traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from litegen.runtime.distributed import DistEnv
from litegen_cli.recipe import load_recipe


@record
def main(argv: list[str] | None = None) -> None:
    """Load the resolved recipe (no overrides: they are already applied) and train.

    Example (what torchrun runs on every rank)::

        python -m litegen_cli.worker results/digits_dit/recipe.resolved.yaml
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m litegen_cli.worker RESOLVED_RECIPE")
    recipe = load_recipe(Path(args[0]))
    _configure_logging(DistEnv.from_environ().rank)

    from litegen.trainer import run_entry

    # base_dir is the ORIGINAL recipe folder (launch.recipe_dir), not the results dir the
    # resolved copy lives in, so relative entry paths resolve as the user wrote them.
    run_entry(recipe.config, entry=recipe.launch.entry, base_dir=recipe.base_dir)
    # Every rank has passed run_entry's final barrier and every file is closed. Leaving now
    # skips the interpreter's teardown of the process groups' C++ threads, which can abort a
    # rank ("terminate called without an active exception") or hang in destroy_process_group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _configure_logging(rank: int) -> None:
    """LiteGen's INFO lines (what was checkpointed, compiled, resumed) from rank 0 only;
    warnings from every rank, tagged with it."""
    from rich.logging import RichHandler

    handler = RichHandler(show_path=False, show_time=False, markup=False)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    logger = logging.getLogger("litegen")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


if __name__ == "__main__":
    main()
