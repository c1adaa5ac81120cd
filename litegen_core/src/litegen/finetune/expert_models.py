"""How the experts of a two-expert pipeline (Wan 2.2 A14B, :mod:`litegen.finetune.experts`)
train: the high-noise expert, the low-noise one, or both in one run.

- :class:`Experts` holds the trained experts as one module, so LoRA, EMA, FSDP, activation
  checkpointing and run checkpoints treat them as one model (keys ``transformer.*`` and
  ``transformer_2.*``); its forward routes each call to the expert of its timestep, as the
  pipeline does.
- :class:`ExpertSchedule` draws the expert of each optimizer step and its noise levels. With both
  experts, step ``s`` trains the high-noise expert with probability equal to the mass of the
  objective's noise-level density at or above the boundary (so the two experts together see the
  density the whole model would), drawn from a generator seeded by ``(global_seed, s)``: every
  rank draws the same expert, and a resumed run draws the same ones again. Every micro-batch of
  a step goes to that step's expert.
- :class:`RangeFlowMatching` draws noise levels from the objective's density truncated to one
  expert's range (inverse-transform sampling between the density's CDF at the range's ends,
  after the shift), so each expert trains only on the noise levels it serves.
- :func:`write_expert_exports`: one export per trained expert, named ``<name>.high_noise`` and
  ``<name>.low_noise`` (LoRA: diffusers and original formats; full fine-tuning: the pipeline
  folder with the trained experts written and the rest linked).

Example::

    schedule = expert_schedule(config, model_index)     # None for a one-transformer pipeline
    model = load_experts(config, schedule)              # in build(config)
    objective_of_step = schedule.objective(step, objective)
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from litegen.finetune.experts import EXPERTS, configured_experts, expert_label, pipeline_boundary
from litegen.objectives.flow_matching import FlowMatching, shift_sigmas

# Where a low-noise range ends below the boundary: timesteps in float32 stay below it.
_BELOW = 1e-6


# -- the objective's density truncated to a range ------------------------------------------------
def _quantile(objective: FlowMatching, v: torch.Tensor) -> torch.Tensor:
    """The density's quantile function (increasing) at ``v`` in [0, 1], before the shift."""
    if objective.density == "uniform":
        return v
    if objective.density == "logit_normal":
        normal = objective.logit_mean + objective.logit_std * math.sqrt(2) * torch.erfinv(2 * v - 1)
        return torch.sigmoid(normal)
    u = 1 - v  # "mode" maps a uniform draw through a decreasing function
    return 1 - u - objective.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


def _cdf(objective: FlowMatching, u: float) -> float:
    """The density's CDF at ``u`` (before the shift): the inverse of :func:`_quantile`."""
    if u <= 0 or u >= 1:
        return min(max(u, 0.0), 1.0)
    if objective.density == "uniform":
        return u
    if objective.density == "logit_normal":
        z = (math.log(u / (1 - u)) - objective.logit_mean) / objective.logit_std
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))
    low, high = 0.0, 1.0  # "mode": bisection on its monotone quantile
    for _ in range(60):
        middle = (low + high) / 2
        below = float(_quantile(objective, torch.tensor(middle, dtype=torch.float64))) < u
        low, high = (middle, high) if below else (low, middle)
    return (low + high) / 2


def _unshift(sigma: float, shift: float) -> float:
    """The inverse of :func:`shift_sigmas`."""
    return sigma / (shift - (shift - 1) * sigma)


def range_mass(
    objective: FlowMatching, low: float, high: float, shift: float | None = None
) -> float:
    """The probability that ``objective`` draws a noise level in ``[low, high]``.

    Example:
        >>> round(range_mass(FlowMatching(density="uniform", shift=3.0), 0.75, 1.0), 4)
        0.5
    """
    shift = objective.shift if shift is None else shift
    return _cdf(objective, _unshift(high, shift)) - _cdf(objective, _unshift(low, shift))


@dataclasses.dataclass(frozen=True)
class RangeFlowMatching(FlowMatching):
    """:class:`FlowMatching` whose noise levels are drawn from its density truncated to
    ``[sigma_min, sigma_max]`` (after the shift): one expert's range.

    Example:
        >>> objective = RangeFlowMatching(density="logit_normal", shift=3.0, sigma_min=0.875)
        >>> bool((objective.sample_sigmas(64) >= 0.875).all())
        True
    """

    sigma_min: float = 0.0
    sigma_max: float = 1.0

    def sample_sigmas(
        self,
        batch_size: int,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
        shift: float | None = None,
    ) -> torch.Tensor:
        shift = self.shift if shift is None else shift
        lo = _cdf(self, _unshift(self.sigma_min, shift))
        hi = _cdf(self, _unshift(self.sigma_max, shift))
        v = lo + (hi - lo) * torch.rand(batch_size, generator=generator, device=device)
        sigmas = shift_sigmas(_quantile(self, v), shift)
        return sigmas.clamp(self.sigma_min, self.sigma_max)  # rounding stays in the range


# -- which expert trains at each step --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExpertSchedule:
    """The trained experts of a two-expert pipeline and the expert of each optimizer step.

    ``boundary`` is the pipeline's ``boundary_ratio``: the high-noise expert serves noise levels
    ``sigma >= boundary`` (timesteps ``>= boundary * num_train_timesteps``). Not indexable, so
    ``build``'s dict hands it to ``train_step`` as it is.

    Example:
        >>> schedule = ExpertSchedule(boundary=0.875, trained=("high", "low"), seed=0)
        >>> objective = FlowMatching(density="uniform", shift=3.0)  # half the mass above 0.75
        >>> schedule.expert_at(7, objective) in ("high", "low")
        True
        >>> schedule.objective(7, objective).sigma_min in (0.0, 0.875)
        True
    """

    boundary: float
    trained: tuple[str, ...]
    seed: int = 0

    def range_of(self, expert: str) -> tuple[float, float]:
        """The noise levels ``[low, high]`` the expert serves."""
        return (self.boundary, 1.0) if expert == "high" else (0.0, self.boundary - _BELOW)

    def expert_at(self, step: int, objective: FlowMatching) -> str:
        """The expert that trains at optimizer step ``step``: the same on every rank and on
        resume (a generator seeded by the seed and the step)."""
        if len(self.trained) == 1:
            return self.trained[0]
        high = range_mass(objective, *self.range_of("high"))
        return "high" if random.Random(f"{self.seed}:{step}").random() < high else "low"

    def objective(self, step: int, objective: FlowMatching) -> RangeFlowMatching:
        """``objective`` restricted to the range of step ``step``'s expert."""
        low, high = self.range_of(self.expert_at(step, objective))
        fields = {f.name: getattr(objective, f.name) for f in dataclasses.fields(FlowMatching)}
        return RangeFlowMatching(**fields, sigma_min=low, sigma_max=high)


def expert_schedule(config: Any, model_index: Mapping[str, Any]) -> ExpertSchedule | None:
    """The run's schedule for a two-expert pipeline; None for one transformer."""
    boundary = pipeline_boundary(model_index)
    if boundary is None:
        return None
    return ExpertSchedule(boundary, configured_experts(config), seed=int(config.global_seed))


# -- the trained experts as one model --------------------------------------------------------
class Experts(nn.Module):
    """The trained experts of a two-expert pipeline, as submodules named by their component
    (``transformer``, ``transformer_2``); a call goes to the expert of its timesteps, as the
    pipeline routes them, and every sample of a batch must fall on one side of the boundary.

    Example:
        >>> from diffusers import WanTransformer3DModel
        >>> from litegen.families.wan import Wan
        >>> experts = Experts({"transformer": WanTransformer3DModel(**Wan.tiny_config)}, 875.0)
        >>> experts.component_for(torch.tensor([900.0, 990.0]))
        'transformer'
    """

    # One expert runs per step: DDP leaves the other's gradients alone (None: not stepped).
    uses_part_per_step = True

    def __init__(self, experts: Mapping[str, nn.Module], boundary_timestep: float) -> None:
        super().__init__()
        for component, module in experts.items():
            self.add_module(component, module)
        self.boundary_timestep = float(boundary_timestep)

    # What a pipeline reads of its transformer (the experts share their config but for weights).
    @property
    def config(self) -> Any:
        return next(self.children()).config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def cache_context(self, name: str, **kwargs: Any) -> Any:
        return next(self.children()).cache_context(name, **kwargs)

    def component_for(self, timestep: torch.Tensor) -> str:
        """The component serving ``timestep`` (one per sample, or per token: its largest)."""
        level = timestep.flatten(1).amax(1) if timestep.dim() > 1 else timestep.reshape(-1)
        high = (level.double() >= self.boundary_timestep).tolist()
        if len(set(high)) != 1:
            raise ValueError(
                f"timesteps {level.tolist()} straddle the experts' boundary "
                f"{self.boundary_timestep}: give one expert's timesteps per call."
            )
        return EXPERTS["high" if high[0] else "low"]

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs: Any) -> Any:
        component = self.component_for(timestep)
        if component not in self._modules:
            raise ValueError(
                f"timestep {timestep.reshape(-1)[0].item()} is served by {component}, which "
                f"this run does not train (it trains {', '.join(self._modules)})."
            )
        return self._modules[component](hidden_states=hidden_states, timestep=timestep, **kwargs)


def experts_of(
    folder: str | Path, trained: tuple[str, ...], lora: Any, boundary_timestep: float
) -> Experts:
    """The experts ``trained`` (``high``, ``low``) of the pipeline folder ``folder`` as one
    :class:`Experts`, each with LoRA adapters of its own when ``lora`` (an
    ``optimization.lora`` section) is given, so each saves like a lone transformer."""
    from litegen.lora import apply_lora
    from litegen.pretrained import load_component

    modules = {EXPERTS[expert]: load_component(folder, EXPERTS[expert]) for expert in trained}
    for module in modules.values() if lora is not None else ():
        apply_lora(module, lora)
    return Experts(modules, boundary_timestep)


def load_experts(config: Any, schedule: ExpertSchedule) -> Experts:
    """The trained experts of ``finetune.pipeline`` (:func:`experts_of`); on the meta device
    for ``runtime.device: meta``."""
    import importlib

    from litegen.finetune.pipeline import pipeline_folder, read_json
    from litegen.lora import apply_lora
    from litegen.pretrained import check_pipeline_folder

    folder = pipeline_folder(config)
    scheduler = read_json(folder / "scheduler" / "scheduler_config.json")
    boundary = schedule.boundary * int(scheduler.get("num_train_timesteps", 1000))
    lora = config.optimization.lora
    if config.runtime.device != "meta":
        return experts_of(folder, schedule.trained, lora, boundary)
    modules = {}
    for expert in schedule.trained:
        library, class_name = check_pipeline_folder(folder)[EXPERTS[expert]]
        cls = getattr(importlib.import_module(library), class_name)
        with torch.device("meta"):
            modules[EXPERTS[expert]] = cls.from_config(cls.load_config(folder / EXPERTS[expert]))
        if lora is not None:
            apply_lora(modules[EXPERTS[expert]], lora)
    return Experts(modules, boundary)


# -- sampling and exports ---------------------------------------------------------------------
_frozen_experts: dict[tuple[str, str], nn.Module] = {}  # loaded once per folder, for sampling


def install_experts(pipe: Any, experts: Experts, folder: str | Path) -> set[str]:
    """Put ``experts`` into ``pipe`` in place of each expert it trains (its forward routes by
    timestep as the pipeline does, and a sharded model gathers its weights through it) and, for
    an expert this run does not train, the pipeline's own (loaded frozen once, in the pipe's
    dtype); returns the components ``experts`` took."""
    from litegen.pretrained import freeze, load_component

    dtype = getattr(pipe, "dtype", None)
    for component in EXPERTS.values():
        module = experts if component in experts._modules else None
        if module is None:
            key = (str(folder), component)
            if key not in _frozen_experts:
                _frozen_experts[key] = freeze(load_component(folder, component, torch_dtype=dtype))
            module = _frozen_experts[key]
        setattr(pipe, component, module)
    return set(experts._modules)


def expert_state(state: Mapping[str, torch.Tensor], component: str) -> dict[str, torch.Tensor]:
    """The part of the :class:`Experts` weights ``state`` that is ``component``'s, keyed as its own."""
    prefix = f"{component}."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def write_expert_exports(
    experts: Experts,
    state: Mapping[str, torch.Tensor],
    pipeline: str | Path,
    out: str | Path,
    *,
    name: str,
    lora_prefix: str,
    write_one: Callable[..., Path],
    write_original: Callable[..., Path] | None = None,
) -> Path:
    """The export of each trained expert (``write_one``: :func:`litegen.finetune.export.write_export`,
    which this module leaves to its callers to import). LoRA: ``out/<name>.high_noise.lora.safetensors`` (and
    ``.peft``, ``.original.lora.safetensors``) for ``transformer``, ``<name>.low_noise.*`` for
    ``transformer_2``. Full fine-tuning: ``out`` becomes the pipeline folder with the trained
    experts written and the other components linked; with ``write_original``
    (:func:`litegen.finetune.export.write_original_weights`) each expert is also written in its original
    layout, ``out/<name>.high_noise.original.safetensors`` and ``<name>.low_noise.*``, as ComfyUI
    loads each expert. Call on one process.

    Example::

        write_expert_exports(experts, state, "tiny_wan22", "results/lora", name="run",
                             lora_prefix="transformer", write_one=write_export)
    """
    from litegen.checkpoint.files import replace_dir
    from litegen.checkpoint.interop import write_diffusers_folder
    from litegen.lora import has_adapters

    out = Path(out)
    if has_adapters(experts):
        for component, module in experts.named_children():
            write_one(module, expert_state(state, component), pipeline, out,
                      name=f"{name}.{expert_label(component)}", lora_prefix=lora_prefix)  # fmt: skip
        return out
    import os
    import shutil
    import uuid

    source = Path(pipeline).resolve()
    partial = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir(parents=True)
    for part in source.iterdir():
        if part.is_dir() and part.name not in experts._modules:
            os.symlink(part.resolve(), partial / part.name, target_is_directory=True)
        elif part.is_file():
            shutil.copy2(part, partial / part.name)
    for component, module in experts.named_children():
        write_diffusers_folder(module, expert_state(state, component), partial / component)
        if write_original is not None:
            file = f"{name}.{expert_label(component)}.original.safetensors"
            write_original(module, expert_state(state, component), partial / file)
    return replace_dir(partial, out)


__all__ = [
    "ExpertSchedule",
    "Experts",
    "RangeFlowMatching",
    "expert_schedule",
    "expert_state",
    "experts_of",
    "install_experts",
    "load_experts",
    "range_mass",
    "write_expert_exports",
]
