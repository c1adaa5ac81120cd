"""Per-rank entry started by torchrun: ``python -m litegen_cli.worker RESOLVED_RECIPE``.

The rank first ties its life to the launcher's (``lifeline.py``), then trains, or, with
``--cache-build REPORT --batch-size N`` (``litegen cache build``), encodes its share of the
recipe's tensor cache (``cache_build.py``). An error ends
the rank with one recorded message and an exit code (``failures.py``), which the launcher turns
into one message for the user; the traceback goes to ``<results_dir>/logs/rank_<r>.log``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from litegen_cli.lifeline import die_with_launcher


def _parse(argv: list[str]) -> argparse.Namespace:
    from litegen_cli.cache_build import CACHE_BUILD_FLAG

    parser = argparse.ArgumentParser(prog="python -m litegen_cli.worker")
    parser.add_argument("recipe", type=Path, metavar="RESOLVED_RECIPE")
    parser.add_argument(CACHE_BUILD_FLAG, dest="cache_report", type=Path, metavar="REPORT")
    parser.add_argument("--batch-size", type=int, default=64)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Load the resolved recipe (no overrides: they are already applied) and train, or fill
    its cache in cache-build mode.

    Example (what torchrun runs on every rank)::

        python -m litegen_cli.worker results/digits_dit/recipe.resolved.yaml
    """
    die_with_launcher()  # before anything slow: a launcher killed meanwhile takes this rank along
    args = _parse(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    results_dir = None
    try:
        from litegen.config.checks import IgnoredOptionWarning

        # The launcher has shown these once already; every rank repeating them is noise.
        warnings.simplefilter("ignore", IgnoredOptionWarning)
        from litegen_cli.recipe import load_recipe

        recipe = load_recipe(args.recipe)
        results_dir = recipe.config.get_results_dir()

        from litegen.runtime.distributed import DistEnv
        from litegen_cli.rank_console import configure_rank_console

        configure_rank_console(DistEnv.from_environ().rank, results_dir)

        if args.cache_report is not None:
            from litegen_cli.cache_build import fill_rank_share

            fill_rank_share(recipe, args.batch_size, args.cache_report)
        else:
            from litegen.trainer import run_entry

            # base_dir is the ORIGINAL recipe folder (launch.recipe_dir), not the results dir
            # the resolved copy lives in, so relative entry paths resolve as the user wrote them.
            run_entry(recipe.config, entry=recipe.launch.entry, base_dir=recipe.base_dir)
    except BaseException as err:  # every failure becomes one recorded message and exit code
        from litegen_cli.failures import record_failure

        code = record_failure(err, rank, results_dir)
        _leave(code)
    # Every rank has passed run_entry's final barrier (or the cache build's gather) and every
    # file is closed. Leaving now
    # skips the interpreter's teardown of the process groups' C++ threads, which can abort a
    # rank ("terminate called without an active exception") or hang in destroy_process_group.
    _leave(0)


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
