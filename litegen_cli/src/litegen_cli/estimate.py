"""`litegen inspect-config RECIPE --estimate`: one step's peak device memory, estimated on meta,
and the sequence layouts (``sp_size x cp_size``) the trained model can take.

The entry's ``build(config)`` runs under ``torch.device("meta")`` with ``runtime.device`` set to
``meta`` (an entry honours it by building on meta and reading no weights), so even a model of
billions of parameters costs no memory and seconds. The trained model gets the changes
``prepare`` makes to its stored weights (:func:`litegen.runtime.steps.apply_estimate_steps`),
one micro-batch of the entry's dataset moves to meta, and the entry's ``train_step`` drives the
forward that :func:`litegen.memory.peak_estimate.estimate_peak` counts; with
``sp_size * cp_size`` above 1 that forward is one rank's share of the sequence
(:func:`litegen.parallel.sequence.apply.one_rank_share`). docs/memory.md says what is counted
and what is not.

Run it without the CLI as ``python -m litegen_cli.estimate RECIPE [KEY=VALUE ...]``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from litegen_cli.failures import EXIT_BAD_INPUT
from litegen_cli.recipe import Recipe
from litegen_cli.run_shape import derive_run_shape

GIB = 2**30
# The estimate leaves out the allocator's caching and fragmentation, so a peak this close to
# the device's size may still not fit.
TIGHT_SHARE = 0.9

EstimateOpt = Annotated[
    bool,
    typer.Option(
        "--estimate",
        help="Also estimate one training step's peak device memory: the models built on the "
        "meta device (no memory, no weights read), one micro-batch's forward counted "
        "(docs/memory.md).",
    ),
]
DeviceGibOpt = Annotated[
    float | None,
    typer.Option(
        "--device-gib",
        min=0.0,
        help="With --estimate: the device memory in GiB to compare the peak with. Default: "
        "optimization.memory.activation_checkpoint.memory_budget_gib, else not compared.",
        show_default=False,
    ),
]


class EstimateError(Exception):
    """The estimate could not be made; the message says why and what to do."""


def estimate_recipe(recipe: Recipe) -> Any:
    """The :class:`~litegen.memory.peak_estimate.PeakEstimate` of the recipe's trained model,
    for one micro-batch (frozen models' weights included); ``EstimateError`` when it fails.

    Example::

        est = estimate_recipe(load_recipe("scripts/bench/sp_dry_run.yaml"))
        est.peak / 2**30
    """
    return estimate_with_layouts(recipe)[0]


def estimate_with_layouts(recipe: Recipe) -> tuple[Any, Any]:
    """:func:`estimate_recipe`, and the trained model's sequence layouts
    (:func:`litegen_cli.layouts.layout_report`; None when the model has no sequence plan).

    Example::

        estimate, layouts = estimate_with_layouts(load_recipe("scripts/bench/sp_dry_run.yaml"))
    """
    from litegen_cli.layouts import layout_report

    try:
        on_meta = _build_on_meta(recipe)
        layouts = layout_report(on_meta.models[on_meta.index], recipe)
        return _estimate(recipe, on_meta), layouts
    except EstimateError:
        raise
    except ValueError as err:  # bad input (a folder, the data, the cache): the user's to fix
        raise EstimateError(f"cannot estimate the peak: {err}") from None
    except Exception as err:  # the user's entry on meta: any failure becomes one message
        raise EstimateError(
            f"cannot estimate the peak of {recipe.launch.entry}: {type(err).__name__}: "
            f"{str(err).rstrip('.')}. "
            "The entry must build its models on the meta device when runtime.device is 'meta' "
            "(no weights read) and its train_step must run there (docs/memory.md)."
        ) from None


@dataclasses.dataclass
class _OnMeta:
    """The entry's parts built on meta, and which model is trained."""

    module: Any
    built: dict[str, Any]
    names: list[str]
    kinds: dict[str, str]
    models: list[Any]
    trained: list[bool]
    index: int
    owners: dict[str, int]


def _build_on_meta(recipe: Recipe) -> _OnMeta:
    import torch

    from litegen.entry import load_entry, parts_to_prepare
    from litegen.runtime.prepare_arguments import kind_of, owner_of, trained_models

    config = recipe.config
    config.runtime.device = "meta"  # not validated on assignment: entries read it to build on meta
    module = load_entry(recipe.launch.entry, recipe.base_dir)
    with torch.device("meta"):
        built = module.build(config)
    names = parts_to_prepare(built, recipe.launch.entry)
    kinds = {name: kind_of(built[name], i) for i, name in enumerate(names)}
    models = [built[n] for n in names if kinds[n] == "model"]
    optimizers = [(i, n) for i, n in enumerate(names) if kinds[n] == "optimizer"]
    owners = {n: owner_of(built[n], i, models) for i, n in optimizers}
    trained = trained_models(models, owners.values())
    if not any(trained):
        raise EstimateError("the entry's build(config) returns no trained model to estimate.")
    return _OnMeta(module, built, names, kinds, models, trained, trained.index(True), owners)


def _estimate(recipe: Recipe, on_meta: _OnMeta | None = None) -> Any:
    import torch

    from litegen.memory.peak_estimate import estimate_peak
    from litegen.runtime.steps import apply_estimate_steps
    from litegen.trainer.hooks import keyword_filter

    config = recipe.config
    run_plan = derive_run_shape(recipe)
    dp_size = run_plan.dp_size
    on_meta = on_meta or _build_on_meta(recipe)
    module, built, names, kinds = on_meta.module, on_meta.built, on_meta.names, on_meta.kinds
    models, trained, index = on_meta.models, on_meta.trained, on_meta.index
    optimizer = next((built[n] for n, o in on_meta.owners.items() if o == index), None)
    model = apply_estimate_steps(models[index], optimizer, config.optimization)
    sharing = run_plan.sp_size * run_plan.cp_size
    if sharing > 1:  # count one rank's share of the sequence, as the ranks will hold it
        from litegen.parallel.sequence import plan_for
        from litegen.parallel.sequence.apply import one_rank_share

        one_rank_share(model, plan_for(model), sharing)
    frozen = _frozen_weight_bytes(
        [m for m, t in zip(models, trained, strict=True) if not t], config.optimization
    )
    data = next(built[n] for n in names if kinds[n] in ("dataset", "dataloader"))
    batch = _to_meta(_one_batch(data, config, dp_size))
    parts = {**built, "gen": None, "config": config, "step": 1}
    kwargs = keyword_filter(module.train_step)(parts)

    def forward() -> Any:
        with torch.device("meta"):
            return module.train_step(batch, **kwargs)

    ac = config.optimization.memory.activation_checkpoint
    budget = None if ac.memory_budget_gib is None else int(ac.memory_budget_gib * GIB)
    estimate = estimate_peak(
        model,
        config.optimization,
        forward,
        grad_accum_steps=config.trainer.grad_accum_steps,
        budget_bytes=budget,
    )
    return dataclasses.replace(
        estimate, weights=estimate.weights + frozen, peak=estimate.peak + frozen
    )


def _frozen_weight_bytes(models: list[Any], optimization: Any) -> int:
    """Frozen models (a VAE, a text encoder) sit on the device whole, cast like the trained one."""
    from litegen.memory.peak_estimate import resident_weight_bytes
    from litegen.precision.dtypes import cast_model

    precision = optimization.precision
    total = 0
    for model in models:
        if precision.cast_model:
            cast_model(model, precision.cast_model, precision.cast_exclude_paths)
        total += resident_weight_bytes(model)
    return total


def _one_batch(data: Any, config: Any, dp_size: int) -> Any:
    """The first micro-batch of rank 0, from the loader ``prepare`` would make of ``data``."""
    from litegen.data import prepare_data

    return next(iter(prepare_data(data, config=config, dp_rank=0, dp_size=dp_size)))


def _to_meta(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.to("meta")
    if isinstance(tree, dict):
        return {k: _to_meta(v) for k, v in tree.items()}
    if isinstance(tree, tuple | list):
        return type(tree)(_to_meta(v) for v in tree)
    return tree


def estimate_table(estimate: Any, device_gib: float | None) -> Table:
    """The estimate as a table in GiB, and whether it fits ``device_gib`` (when given).

    Example::

        console.print(estimate_table(estimate_recipe(recipe), device_gib=140))
    """
    table = Table(title="Peak device memory, estimated (one step)", title_justify="left")
    table.add_column("part", style="bold")
    table.add_column("GiB", justify="right")
    table.add_column("bytes", justify="right")
    rows = [
        ("weights", estimate.weights),
        ("gradients", estimate.gradients),
        ("optimizer", estimate.optimizer),
        ("activations", estimate.activations),
        ("peak", estimate.peak),
    ]
    for name, value in rows:
        table.add_row(name, f"{value / GIB:.2f}", f"{value:,}")
    checkpointed = f"{estimate.checkpointed} of {estimate.blocks} checkpointed"
    table.add_row("blocks", checkpointed, f"{estimate.offloaded} offloaded")
    if device_gib is not None:
        table.add_row("device", f"{device_gib:g}", escape(verdict(estimate.peak, device_gib)))
    return table


def verdict(peak: int, device_gib: float) -> str:
    """Whether ``peak`` bytes fit a device of ``device_gib``: ``fits``, ``tight`` (above
    :data:`TIGHT_SHARE` of it) or ``does not fit``.

    Example:
        >>> verdict(50 * GIB, 80), verdict(76 * GIB, 80), verdict(81 * GIB, 80)
        ('fits', 'tight: within 10% of the device, fragmentation not counted', 'does not fit')
    """
    if peak > device_gib * GIB:
        return "does not fit"
    if peak > TIGHT_SHARE * device_gib * GIB:
        return f"tight: within {1 - TIGHT_SHARE:.0%} of the device, fragmentation not counted"
    return "fits"


def print_estimate(recipe: Recipe, device_gib: float | None) -> int:
    """Print the estimate's table and return 0, or print why it failed and return 2.

    ``device_gib`` defaults to the recipe's ``activation_checkpoint.memory_budget_gib``;
    without either, the peak is not compared.

    Example::

        raise typer.Exit(print_estimate(load_recipe("recipe.yaml"), device_gib=140))
    """
    from litegen_cli.layouts import layouts_table
    from litegen_cli.render import console, print_error

    try:
        estimate, layouts = estimate_with_layouts(recipe)
    except EstimateError as err:
        print_error("Cannot estimate the peak memory", [str(err)])
        return EXIT_BAD_INPUT
    if device_gib is None:
        device_gib = recipe.config.optimization.memory.activation_checkpoint.memory_budget_gib
    console.print(estimate_table(estimate, device_gib))
    if layouts is not None:
        if layouts.layouts:
            console.print(layouts_table(layouts))
        if layouts.problem:
            print_error("Bad input", [layouts.problem])
            return EXIT_BAD_INPUT
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m litegen_cli.estimate RECIPE [KEY=VALUE ...] [--device-gib N]``: the same as
    ``litegen inspect-config RECIPE ... --estimate``."""
    from litegen_cli.app import app

    args = sys.argv[1:] if argv is None else argv
    app(["inspect-config", "--estimate", *args], prog_name="litegen")


if __name__ == "__main__":
    main()
