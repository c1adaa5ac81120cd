"""The family matrix: every family of the registry x every conditioning it takes x {ddp, fsdp2},
each one `litegen launch` of the fine-tuning recipe (`launch.entry: litegen.finetune`) on the
family's tiny pipeline with LoRA and EMA, 2 gloo ranks on the CPU; and each family training its
whole transformer under both strategies. A conditioning is the set of condition files the media
folder gives (`Family.media_conditions`, as companion files; "text": none, so the conditions'
defaults apply), and the validation prompt gets a file for each condition the pipeline samples
with. Per run, by numbers:

- it trains: finite losses at every step, the trained weights moved;
- its validation sample is written, at the size and frame count asked;
- LoRA: the diffusers-format export (`lora/<exp>.ema.lora.safetensors`) and the original-format
  one (`lora/<exp>.ema.original.lora.safetensors`), each through `pipe.load_lora_weights` on a
  pipeline of the tiny folder, and the peft folder through `PeftModel.from_pretrained`, give the
  outputs of the run's EMA adapters loaded by LiteGen's own loader, to fp32 rounding;
- full fine-tuning: the pipeline export loads with `DiffusionPipeline.from_pretrained` with the
  EMA weights, and `litegen export --original` writes one file that the transformer class's
  `from_single_file` reads back with the same weights.

A two-expert family (Wan 2.2 A14B) is checked per expert: each expert's adapters or weights,
and its exports (`<exp>.ema.high_noise.*`, `<exp>.ema.low_noise.*` loaded with
`load_into_transformer_2=True`), compared at a noise level the expert serves.

What diffusers cannot read of a family's tiny pipeline is skipped with the reason the family
declares (`Family.tiny_export_limits`); a family without an original key map skips its
original-format checks, saying so.

The whole matrix is marked ``family_matrix`` and runs with

    uv run --locked pytest -m family_matrix tests/distributed/test_family_matrix.py

(about 40 CPU-seconds per launch: 25 s on 2 idle cores). The default suite runs a sample (the cases not marked
``matrix``): Wan with LoRA under ddp and Flux with LoRA under fsdp2.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tests.distributed.family_matrix import (
    Case,
    Part,
    Run,
    assert_same_state,
    diffusers_pipeline,
    full_cases,
    launch,
    limit,
    load_lora_into,
    lora_cases,
    make_media,
    outputs,
    part_state,
    trained_lora_parts,
)
from tests.pipelines import tiny_pipeline_folder

pytest.importorskip("diffusers")
pytest.importorskip("av")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow

# The default suite's cases: a video family under ddp, an image family under fsdp2.
SAMPLE = {Case("wan", "text", "ddp"), Case("flux", "text", "fsdp2")}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32 rounding
MOVED = 1e-3  # the trained outputs differ from the base model's by more than this


def params(cases: list[Case]) -> list:
    """Every case marked ``family_matrix``; those outside :data:`SAMPLE` also ``matrix``,
    which the default suite deselects."""
    return [
        pytest.param(
            case,
            id=case.id,
            marks=[pytest.mark.family_matrix] + ([] if case in SAMPLE else [pytest.mark.matrix]),
        )
        for case in cases
    ]


@pytest.fixture(scope="session")
def media_folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], Path]:
    """The media folder of a case: clips or images, and its condition files; one per kind of
    family and conditions, shared by the cases that train on the same."""
    made: dict[tuple, Path] = {}

    def folder(case: Case) -> Path:
        video = case.family_class.latent.is_video
        conditions = case.condition_kinds(case.given)
        key = (video, tuple(sorted(conditions.items())))
        if key not in made:
            made[key] = make_media(tmp_path_factory.mktemp("media"), video, conditions)
        return made[key]

    return folder


@pytest.fixture(scope="session")
def caches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache root for every run: a family's second run reads what its first encoded."""
    return tmp_path_factory.mktemp("cache")


def run_case(case: Case, media_folders, caches: Path, tmp_path_factory) -> Run:
    results = tmp_path_factory.mktemp(case.id) / "results"
    pipeline = tiny_pipeline_folder(case.family)
    return launch(case, pipeline, media_folders(case), caches, results)


@pytest.fixture(scope="module", params=params(lora_cases()))
def lora_run(request, media_folders, caches: Path, tmp_path_factory) -> Run:
    return run_case(request.param, media_folders, caches, tmp_path_factory)


@pytest.fixture(scope="module", params=params(full_cases()))
def full_run(request, media_folders, caches: Path, tmp_path_factory) -> Run:
    return run_case(request.param, media_folders, caches, tmp_path_factory)


# -- training and samples ---------------------------------------------------------------------
def check_trained_and_sampled(run: Run) -> None:
    losses = run.losses()
    assert len(losses) == run.config.max_steps and all(torch.isfinite(torch.tensor(losses)))
    validation = run.config.trainer.validation
    grid = (validation.height + 4, validation.width + 4)  # one sample, padded by 2 each side
    video = run.case.family_class.latent.is_video
    sample = run.results / "samples" / f"step_{run.config.max_steps}"
    if video:
        import av

        with av.open(str(sample / "samples.mp4")) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == validation.frames
        assert all(f.shape == (*grid, 3) for f in frames)
    else:
        from PIL import Image

        with Image.open(sample / "samples.png") as png:
            assert (png.height, png.width) == grid


def check_every_expert_trained(run: Run) -> None:
    """A two-expert run trains one expert per step: its steps drew both."""
    if run.boundary is not None:
        assert run.drawn_experts() == {"high", "low"}, "pick a global_seed that draws both"


def test_lora_run_trains_and_samples(lora_run: Run) -> None:
    check_trained_and_sampled(lora_run)
    check_every_expert_trained(lora_run)
    # peft starts every lora_B at zero: each moved, in the model and in its EMA, per part.
    prefix = f"{lora_run.config.optimization.lora.prefix}."
    for suffix in ("lora", "ema.lora"):
        adapters = load_file(lora_run.results / f"{lora_run.case.exp_name}.{suffix}.safetensors")
        for part in lora_run.parts:
            own = part_state(lora_run, adapters, part, prefix)
            ups = {k: v for k, v in own.items() if ".lora_B." in k}
            assert ups and all(v.count_nonzero() for v in ups.values()), (suffix, part)


def test_full_run_trains_and_samples(full_run: Run) -> None:
    from litegen.pretrained import load_component

    check_trained_and_sampled(full_run)
    check_every_expert_trained(full_run)
    ema = ema_weights(full_run)
    for part in full_run.parts:
        base = load_component(full_run.pipeline, part.component).state_dict()
        own = part_state(full_run, ema, part)
        assert own.keys() == base.keys()
        assert any(not torch.equal(own[k], v) for k, v in base.items()), part


# -- LoRA exports -----------------------------------------------------------------------------
def trained_outputs(run: Run) -> dict[str, torch.Tensor]:
    """The outputs of the run's EMA adapters (the trainer's own file, LiteGen's loader), per
    trained component, at a noise level it serves; each differs from the base model's."""
    from litegen.pretrained import load_component

    trained = trained_lora_parts(run, f"{run.case.exp_name}.ema.lora.safetensors")
    out = {}
    for part in run.parts:
        out[part.component] = outputs(run, trained[part.component], part.sigma)
        base = outputs(run, load_component(run.pipeline, part.component), part.sigma)
        assert (out[part.component] - base).abs().max() > MOVED, part
    return out


def test_lora_exports_load_in_diffusers_and_peft_as_trained(lora_run: Run) -> None:
    from peft import PeftModel

    from litegen.pretrained import load_component

    trained = trained_outputs(lora_run)
    folder, name = lora_run.results / "lora", f"{lora_run.case.exp_name}.ema"
    pipe = diffusers_pipeline(lora_run)
    for part in lora_run.parts:
        load_lora_into(pipe, folder / f"{name}{part.label}.lora.safetensors", part)
    for part in lora_run.parts:
        got = outputs(lora_run, getattr(pipe, part.component), part.sigma)
        torch.testing.assert_close(got, trained[part.component], **TOLERANCE)
        base = load_component(lora_run.pipeline, part.component)
        through_peft = PeftModel.from_pretrained(base, str(folder / f"{name}{part.label}.peft"))
        got = outputs(lora_run, through_peft, part.sigma)
        torch.testing.assert_close(got, trained[part.component], **TOLERANCE)


def test_original_lora_loads_in_diffusers_as_trained(lora_run: Run) -> None:
    case = lora_run.case
    folder = lora_run.results / "lora"
    paths = {
        part: folder / f"{case.exp_name}.ema{part.label}.original.lora.safetensors"
        for part in lora_run.parts
    }
    if case.family_class.original_keys is None:
        assert not [path for path in paths.values() if path.exists()]
        pytest.skip(f"{case.family} has no original key map (Family.original_keys)")
    assert all(path.is_file() for path in paths.values())
    trained = trained_outputs(lora_run)
    reason = limit(case, "original_lora")
    if reason:
        # What can be checked without diffusers: LiteGen's inverse gives the trained adapters.
        for part, path in paths.items():
            check_original_lora_round_trip(lora_run, part, path)
        pytest.skip(f"{case.family}: {reason}")
    pipe = diffusers_pipeline(lora_run)
    for part, path in paths.items():
        load_lora_into(pipe, path, part)
    for part in lora_run.parts:
        got = outputs(lora_run, getattr(pipe, part.component), part.sigma)
        torch.testing.assert_close(got, trained[part.component], **TOLERANCE)


def check_original_lora_round_trip(run: Run, part: Part, path: Path) -> None:
    """The original-format file read back by LiteGen's inverse converter adds to each module
    what the trained adapters add (``alpha / rank * B @ A``; a fused module may read back at
    the fused rank, its unadapted parts with zero deltas)."""
    from litegen.lora import adapter_alpha_state
    from litegen.model_keys.original_format import lora_from_original, output_rows

    model = trained_lora_parts(run, f"{run.case.exp_name}.ema.lora.safetensors")[part.component]
    want = deltas(adapter_alpha_state(model, model.state_dict()))
    rows = output_rows(model)
    got = deltas(
        lora_from_original(load_file(path), run.case.family_class.original_keys, rows=rows)
    )
    assert want.keys() <= got.keys()
    assert not [m for m in got.keys() - want.keys() if got[m].count_nonzero()]
    for module, delta in want.items():
        torch.testing.assert_close(got[module], delta, rtol=1e-5, atol=1e-7, msg=module)


def deltas(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each adapted module adds to its weight: ``alpha / rank * lora_B @ lora_A``."""
    out = {}
    for key, down in adapters.items():
        module, sep, _ = key.partition(".lora_A.weight")
        if sep:
            up, alpha = adapters[f"{module}.lora_B.weight"], adapters[f"{module}.alpha"]
            out[module] = float(alpha) / down.shape[0] * (up.double() @ down.double())
    return out


# -- full fine-tuning exports -----------------------------------------------------------------
def ema_weights(run: Run) -> dict[str, torch.Tensor]:
    return torch.load(run.results / f"{run.case.exp_name}.ema.pth", weights_only=True)


def test_full_pipeline_export_loads_in_diffusers_as_trained(full_run: Run) -> None:
    from diffusers import DiffusionPipeline

    unloaded = {name: None for name in full_run.case.family_class.unloaded_components}
    exported = DiffusionPipeline.from_pretrained(full_run.results / "pipeline", **unloaded)
    ema = ema_weights(full_run)
    for part in full_run.parts:
        transformer = getattr(exported, part.component)
        assert type(transformer).__name__ == full_run.case.family_class.transformer_class
        assert_same_state(transformer.state_dict(), part_state(full_run, ema, part))


def test_full_original_export_loads_with_from_single_file(full_run: Run, tmp_path: Path) -> None:
    import diffusers

    from litegen_cli.app import app

    case = full_run.case
    family = case.family_class
    if family.original_keys is None:
        pytest.skip(f"{case.family} has no original key map (Family.original_keys)")
    out = tmp_path / "export"
    step = full_run.results / f"step_{full_run.config.max_steps}"
    result = CliRunner().invoke(
        app, ["export", "--from", str(step), "--original", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    files = {part: out / f"{case.exp_name}.ema{part.label}.original.safetensors"
             for part in full_run.parts}  # fmt: skip
    assert sorted(f.name for f in out.glob("*.original.safetensors")) == sorted(
        f.name for f in files.values()
    )
    ema = ema_weights(full_run)
    reason = limit(case, "original_weights")
    for part, file in files.items():
        want = part_state(full_run, ema, part)
        if reason:
            # What can be checked without diffusers: LiteGen's inverse gives the trained weights.
            from litegen.model_keys.original_format import output_rows, weights_from_original
            from litegen.pretrained import load_component

            rows = output_rows(load_component(full_run.pipeline, part.component))
            back = weights_from_original(load_file(file), family.original_keys, rows=rows)
            assert_same_state(back, want)
            continue
        cls = getattr(diffusers, family.transformer_class)
        loaded = cls.from_single_file(
            str(file), config=str(full_run.pipeline / part.component), local_files_only=True
        )
        assert_same_state(loaded.state_dict(), want)
    if reason:
        pytest.skip(f"{case.family}: {reason}")
