"""The cases of the family matrix (tests/distributed/test_family_matrix.py) and what each case
runs and reads back: one `litegen launch` of a fine-tuning recipe on a family's tiny pipeline,
the parts it trains (the transformer, or each expert of a two-expert pipeline), the outputs its
exports are compared on, and the family's declared limits.

Every family of the registry (:func:`litegen.families.families`) and every conditioning it
takes join the matrix by themselves: nothing here names a family.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
STRATEGIES = ("ddp", "fsdp2")
TEXT = "text"  # the conditioning every family takes: the caption alone
LAUNCH_TIMEOUT_S = 300
MAX_STEPS = 4
# The tiny pipelines' size: two 32x32 samples per step; 9 frames for a video family. A high
# learning rate and a short EMA, so that 4 steps move the exported adapters far enough for
# "equal to the trained outputs" to tell them from the base model.
SHORT = (
    "runtime.device=cpu",
    "launch.nproc_per_node=2",
    "optimization.precision.preset=null",
    "global_batch_size=2",
    f"max_steps={MAX_STEPS}",
    "lr=1e-3",
    "ema.decay=0.5",
    f"trainer.sample_every={MAX_STEPS}",
    "trainer.log_every=1",
    "finetune.data.resolution=32",
    "trainer.validation.steps=2",
    "trainer.validation.height=32",
    "trainer.validation.width=32",
)
VIDEO = ("finetune.data.max_frames=9", "trainer.validation.frames=9")
# A two-expert run trains one expert per step: global seed 1 draws both in 4 steps (checked).
TWO_EXPERTS = ("global_seed=1",)


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of the matrix: a family, a conditioning, a strategy, LoRA or the whole model."""

    family: str
    conditioning: str
    strategy: str
    lora: bool = True

    @property
    def id(self) -> str:
        return (
            f"{self.family}-{self.conditioning}-{self.strategy}-{'lora' if self.lora else 'full'}"
        )

    @property
    def family_class(self) -> Any:
        from litegen.families import family_named

        return family_named(self.family)

    @property
    def recipe(self) -> Path:
        video = self.family_class.latent.is_video
        return RECIPES / ("finetune_video.yaml" if video else "finetune_image.yaml")

    @property
    def exp_name(self) -> str:
        return self.id.replace("-", "_").replace("+", "_")

    @property
    def given(self) -> tuple[str, ...]:
        """The condition files its media folder gives."""
        return () if self.conditioning == TEXT else tuple(self.conditioning.split("+"))

    @property
    def sampled_with(self) -> tuple[str, ...]:
        """The conditions its validation sample gets a file for: those it gives, and those
        the pipeline cannot sample without."""
        conditions = media_conditions(self.family_class)
        needed = [name for name, condition in conditions.items() if not condition.optional]
        return tuple(sorted({*self.given, *needed}))

    @property
    def two_experts(self) -> bool:
        """A two-expert family (Wan 2.2 A14B): ``transformer`` and ``transformer_2`` train."""
        return len(self.family_class.trained) > 1

    def condition_kinds(self, names: tuple[str, ...]) -> dict[str, str]:
        """``image`` or ``video``, by condition name."""
        conditions = media_conditions(self.family_class)
        return {name: conditions[name].kind for name in names}


def media_conditions(family: Any) -> dict[str, Any]:
    """The files beyond the caption a sample of ``family`` brings, by name
    (``Family.media_conditions``: a first frame, a reference image, a control video)."""
    return dict(getattr(family, "media_conditions", {}))


def conditionings(family: Any) -> list[str]:
    """The conditionings a family trains with, each the condition files its media folder
    gives (joined by ``+``): none (:data:`TEXT`: the caption alone, and the defaults of its
    conditions, such as a clip's own first frame) unless one is required, and each condition
    it takes, with the required ones."""
    conditions = media_conditions(family)
    required = sorted(name for name, condition in conditions.items() if condition.required)
    given = [required] + [sorted([*required, name]) for name in conditions if name not in required]
    return ["+".join(names) or TEXT for names in given]


def lora_cases() -> list[Case]:
    """Every family x conditioning x strategy, with LoRA and EMA."""
    from litegen.families import families

    return [
        Case(name, conditioning, strategy)
        for name, family in families().items()
        for conditioning in conditionings(family)
        for strategy in STRATEGIES
    ]


def full_cases() -> list[Case]:
    """Every family x strategy training its whole transformer, at its first conditioning
    (the caption alone, or the conditions it requires)."""
    from litegen.families import families

    return [
        Case(name, conditionings(family)[0], strategy, lora=False)
        for name, family in families().items()
        for strategy in STRATEGIES
    ]


@dataclasses.dataclass(frozen=True)
class Part:
    """What a run trains and exports apart: its transformer, or one expert of a two-expert
    pipeline, with the name part of that expert's exports and a noise level it serves."""

    component: str  # the pipeline component: transformer, transformer_2
    label: str  # "" for a lone transformer, ".high_noise" or ".low_noise" for an expert
    sigma: float  # the noise level its outputs are compared at


@dataclasses.dataclass
class Run:
    """A finished launch: its case, folders and the overrides it ran with."""

    case: Case
    pipeline: Path
    results: Path
    overrides: list[str]

    @functools.cached_property
    def config(self) -> Any:
        from litegen_cli.recipe import load_recipe

        return load_recipe(self.case.recipe, self.overrides).config

    @functools.cached_property
    def batch(self) -> dict[str, torch.Tensor]:
        """The first media file's cached latents and conditions, as a batch of one, in fp32:
        the entries the family's training forward reads, whatever its conditions."""
        from litegen.finetune.cache import cache_keys, open_cache
        from litegen.finetune.media import media_dataset
        from litegen.finetune.pipeline import pipeline_family

        family = pipeline_family(self.config)
        dataset = media_dataset(self.config, family)
        entry = open_cache(self.config, family, dataset).get(cache_keys(dataset)[0])
        assert entry is not None, f"the run's cache lacks {dataset.files[0].path}"
        return {name: value[None].float() for name, value in entry.items()}

    @functools.cached_property
    def boundary(self) -> float | None:
        """The pipeline's ``boundary_ratio`` (two experts); None for one transformer."""
        from litegen.finetune.experts import pipeline_boundary

        index = json.loads((self.pipeline / "model_index.json").read_text(encoding="utf-8"))
        return pipeline_boundary(index)

    @property
    def parts(self) -> list[Part]:
        """The transformer, or the high-noise expert (compared above the boundary) and the
        low-noise one (below it)."""
        from litegen.finetune.experts import expert_label

        if self.boundary is None:
            return [Part("transformer", "", 0.5)]
        return [
            Part(component, f".{expert_label(component)}", sigma)
            for component, sigma in (
                ("transformer", (1 + self.boundary) / 2),
                ("transformer_2", self.boundary / 2),
            )
        ]

    def drawn_experts(self) -> set[str]:
        """The experts (``high``, ``low``) the run's steps trained."""
        from litegen.finetune.expert_models import expert_schedule
        from litegen.finetune.pipeline import make_objective, read_json

        schedule = expert_schedule(self.config, read_json(self.pipeline / "model_index.json"))
        objective = make_objective(self.config)
        return {schedule.expert_at(s, objective) for s in range(1, self.config.max_steps + 1)}

    def losses(self) -> list[float]:
        lines = (self.results / "metrics.jsonl").read_text().splitlines()
        return [row["loss"] for row in map(json.loads, lines) if "loss" in row]


def make_media(root: Path, video: bool, conditions: Mapping[str, str]) -> Path:
    """Four clips (a video family) or four images, each with a caption and a companion file
    ``<stem>.<name>.<ext>`` per condition (``conditions``: name -> image or video)."""
    from tests.media import make_media_folder, write_mp4, write_png

    make_media_folder(root, images=0 if video else 4, videos=4 if video else 0, frames=9)
    for media in sorted([*root.glob("*/*.mp4"), *root.glob("*/*.png")]):
        for name, kind in conditions.items():
            if kind == "video":
                write_mp4(media.with_name(f"{media.stem}.{name}.mp4"), 48, 32, frames=9)
            else:
                write_png(media.with_name(f"{media.stem}.{name}.png"), 48, 32, color=(250, 120, 0))
    given = [p for name in conditions for p in root.glob(f"*/*.{name}.*")]
    assert len(given) == 4 * len(conditions)  # one companion per file and condition
    return root


def validation_files(folder: Path, conditions: Mapping[str, str]) -> list[str]:
    """The override giving the validation prompt one file per condition (``conditions``:
    name -> image or video), written into ``folder``; none without conditions."""
    from tests.media import write_mp4, write_png

    if not conditions:
        return []
    files = {}
    for name, kind in conditions.items():
        if kind == "video":
            files[name] = write_mp4(folder / f"validation.{name}.mp4", 32, 32, frames=9)
        else:
            # 64 pixels: Flux.2's image processor refuses smaller reference images.
            files[name] = write_png(folder / f"validation.{name}.png", 64, 64, color=(0, 200, 90))
    given = ", ".join(f"{name}: [{path}]" for name, path in files.items())
    return [f"trainer.validation.conditions={{{given}}}"]


def launch(case: Case, pipeline: Path, media: Path, cache_root: Path, results: Path) -> Run:
    """`litegen launch <recipe> ...` for ``case`` on 2 gloo ranks, to the end."""
    results.parent.mkdir(parents=True, exist_ok=True)
    sampled_with = case.condition_kinds(case.sampled_with)
    overrides = [
        *validation_files(results.parent, sampled_with),
        *SHORT,
        *(VIDEO if case.family_class.latent.is_video else ()),
        *(TWO_EXPERTS if case.two_experts else ()),
        f"optimization.parallel.strategy={case.strategy}",
        f"exp_name={case.exp_name}",
        f"finetune.pipeline={pipeline}",
        f"finetune.data.folder={media}",
        f"finetune.data.cache_root={cache_root}",
        f"results_dir={results}",
        # A full fine-tune keeps its last step's checkpoint for `litegen export --original`.
        *(() if case.lora else ("optimization.lora=null", f"trainer.checkpoint_every={MAX_STEPS}")),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    args = [sys.executable, "-m", "litegen_cli.app", "launch", str(case.recipe), *overrides]
    try:
        proc = subprocess.run(
            args, cwd=results.parent, env=env, capture_output=True, text=True,
            timeout=LAUNCH_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{case.id} did not finish in {LAUNCH_TIMEOUT_S}s:\n{str(err.output)[-4000:]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{case.id} failed:\n{out[-6000:]}"
    return Run(case, pipeline, results, overrides)


# -- what the exports are compared on --------------------------------------------------------
@torch.no_grad()
def outputs(run: Run, transformer: torch.nn.Module, sigma: float = 0.5) -> torch.Tensor:
    """``transformer``'s prediction through the family's training forward, on the first cached
    sample noised to ``sigma`` (fixed noise)."""
    from litegen.finetune.pipeline import pipeline_family

    batch = run.batch
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(0))
    noisy = (1 - sigma) * batch["latents"] + sigma * noise
    sigmas = torch.tensor([sigma])
    return pipeline_family(run.config).predict(transformer.eval(), noisy, sigmas, batch)


def trained_lora_parts(run: Run, file: str) -> dict[str, torch.nn.Module]:
    """Fresh transformers of the tiny folder (each trained part's, by component) with the
    run's adapters from ``file`` (a file the trainer wrote), through LiteGen's own loader."""
    from litegen.checkpoint.files import load_state
    from litegen.finetune.expert_models import experts_of
    from litegen.lora import apply_lora, model_keyed
    from litegen.pretrained import load_component

    lora = run.config.optimization.lora
    if run.boundary is None:
        model = apply_lora(load_component(run.pipeline, "transformer"), lora)
    else:  # both experts as the run held them, so the file's keys match
        model = experts_of(run.pipeline, ("high", "low"), lora, run.boundary * 1000)
    path = run.results / file
    adapters = model_keyed(model, load_state(path), lora.prefix, path)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k]
    return {"transformer": model} if run.boundary is None else dict(model.named_children())


def part_state(run: Run, state: Mapping[str, Any], part: Part, prefix: str = "") -> dict:
    """The entries of a state keyed as the run's model (weights, or adapters under the key
    prefix ``prefix``, such as ``transformer.``) that are ``part``'s, keyed as its own model's."""
    if run.boundary is None:
        return dict(state)
    head = f"{prefix}{part.component}."
    return {k[len(head) :]: v for k, v in state.items() if k.startswith(head)}


def load_lora_into(pipe: Any, path: Path, part: Part) -> None:
    """``pipe.load_lora_weights`` of ``path`` into ``part``'s component (a low-noise expert:
    ``load_into_transformer_2``)."""
    if not hasattr(pipe, "load_lora_weights"):
        # A pipeline without diffusers' LoRA loader mixin (HunyuanVideo 1.5): its model's.
        getattr(pipe, part.component).load_lora_adapter(str(path), prefix="transformer")
    elif part.component == "transformer_2":
        pipe.load_lora_weights(str(path), load_into_transformer_2=True)
    else:
        pipe.load_lora_weights(str(path))


def diffusers_pipeline(run: Run) -> Any:
    from diffusers import DiffusionPipeline

    unloaded = {name: None for name in run.case.family_class.unloaded_components}
    pipe = DiffusionPipeline.from_pretrained(run.pipeline, **unloaded)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def limit(case: Case, export: str) -> str | None:
    """Why diffusers cannot read ``export`` of the family's tiny pipeline, where the family
    declares it (``Family.tiny_export_limits``); None when it can."""
    return dict(getattr(case.family_class, "tiny_export_limits", {})).get(export)


def assert_same_state(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k].float(), want[k].float())]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


__all__ = [
    "STRATEGIES",
    "TEXT",
    "Case",
    "Part",
    "Run",
    "assert_same_state",
    "conditionings",
    "diffusers_pipeline",
    "full_cases",
    "launch",
    "limit",
    "load_lora_into",
    "lora_cases",
    "make_media",
    "media_conditions",
    "outputs",
    "part_state",
    "trained_lora_parts",
]
