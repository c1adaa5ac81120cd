"""Built-in sequence-parallel plans for diffusers' video and image transformers, and the
lookup of a model's plan (:func:`plan_for`, :func:`register_sequence_plan`).

Each plan splits the video (or image) tokens where the blocks start, splits what is computed
per token over the whole sequence before them (rotary embeddings, per-token timesteps), and
gathers the output of the final projection; the text stays whole.

diffusers' own context-parallel plans (``_cp_plan``, on Wan and LTX-Video) split the same
video-token tensors, but they also split the text, because diffusers' Ulysses all-to-alls
every attention's keys and values, cross-attention's included. LiteGen keeps the text whole,
so cross-attention needs no communication; the shared entries are checked against diffusers'
in the tests.

The plans of the classes a model family trains live in that family's module
(:meth:`litegen.families.base.Family.sequence_plan`); :func:`builtin_plan` looks there first,
then in :data:`BUILTIN`.

Example:
    >>> "LTXVideoTransformer3DModel" in builtin_names(), "CogVideoXTransformer3DModel" in BUILTIN
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from litegen.parallel.sequence.sequence_plan import PLAN_ATTRIBUTE, SequencePlan


def hunyuan_video(model: nn.Module) -> SequencePlan:
    """HunyuanVideo: joint attention over [video, text] in the dual- and single-stream blocks.

    The attention mask is built over the whole [video, text] sequence before the split, which is
    the layout the all-to-all restores. The image-to-video variant that replaces the first
    frame's tokens (``image_condition_type: token_replace``) is not supported: those tokens sit
    on the first rank only.
    """
    if getattr(model.config, "image_condition_type", None) == "token_replace":
        raise ValueError(
            "sequence parallelism does not support HunyuanVideo's image_condition_type "
            "'token_replace' (the first frame's tokens are replaced on one rank only); set "
            "optimization.parallel.sp_size: 1 for this model."
        )
    blocks = ("transformer_blocks.*.attn", "single_transformer_blocks.*.attn")
    return SequencePlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": 1}},
        split_outputs={"rope": {0: 0, 1: 0}},  # cos and sin, (S, D) each
        gather_outputs={"proj_out": 1},
        attention=dict.fromkeys(blocks, "text_last"),
    )


def cogvideox(model: nn.Module) -> SequencePlan:
    """CogVideoX: joint attention over [text, video]; the rotary embedding comes as an input."""
    return SequencePlan(
        split_inputs={
            "": {"image_rotary_emb": 0},  # (cos, sin), (S, D) each, when the model uses RoPE
            "transformer_blocks.0": {"hidden_states": 1},
        },
        gather_outputs={"proj_out": 1},
        attention={"transformer_blocks.*.attn1": "text_first"},
    )


def dit_style(model: nn.Module) -> SequencePlan:
    """DiT and PixArt-alpha/sigma: position embedding added by the patch embedding, then blocks
    of self-attention (and, for PixArt, cross-attention to the text)."""
    final = "proj_out_2" if hasattr(model, "proj_out_2") else "proj_out"
    return SequencePlan(
        split_inputs={"transformer_blocks.0": {"hidden_states": 1}},
        gather_outputs={final: 1},
        attention={"transformer_blocks.*.attn1": "self"},
    )


# diffusers class name -> plan function; only classes defined in diffusers match.
BUILTIN: dict[str, Callable[[nn.Module], SequencePlan]] = {
    "HunyuanVideoTransformer3DModel": hunyuan_video,
    "CogVideoXTransformer3DModel": cogvideox,
    "DiTTransformer2DModel": dit_style,
    "PixArtTransformer2DModel": dit_style,
}


def family_plans() -> dict[str, Callable[[nn.Module], SequencePlan]]:
    """The plans the model families declare, by transformer class name."""
    from litegen.families import Family, families  # they import this package's plan module

    declared = Family.sequence_plan.__func__
    return {
        family.transformer_class: family.sequence_plan
        for family in families().values()
        if family.sequence_plan.__func__ is not declared
    }


def builtin_names() -> list[str]:
    """The diffusers classes with a built-in plan: the families' and :data:`BUILTIN`'s."""
    return sorted({*family_plans(), *BUILTIN})


def builtin_plan(model: nn.Module) -> Callable[[nn.Module], SequencePlan] | None:
    """The built-in plan function for ``model``'s class, if it is a diffusers class we know:
    its family's plan first, then :data:`BUILTIN`'s."""
    cls = type(model)
    if not cls.__module__.startswith("diffusers."):
        return None
    return family_plans().get(cls.__name__) or BUILTIN.get(cls.__name__)


# -- where a model's plan comes from ----------------------------------------------------------
PlanSource = SequencePlan | Callable[[nn.Module], SequencePlan]
_REGISTERED: dict[type, PlanSource] = {}


def register_sequence_plan(cls: type, plan: PlanSource) -> None:
    """Use ``plan`` (or ``plan(model)``) for every model of class ``cls`` (not subclasses).

    Example::

        register_sequence_plan(MyDiT, SequencePlan(
            split_inputs={"blocks.0": {"x": 1}}, gather_outputs={"head": 1},
            attention={"blocks.*.attn": "self"}))
    """
    _REGISTERED[cls] = plan


def plan_for(model: nn.Module) -> SequencePlan:
    """The plan of ``model`` (in the order :mod:`litegen.parallel.sequence.sequence_plan` gives, then
    one read from a diffusers ``_cp_plan``: :mod:`.diffusers_cp`), checked against it;
    ValueError if none.

    Example::

        plan_for(wan).gather_outputs
    """
    from litegen.parallel.sequence.diffusers_cp import has_cp_plan, plan_from_cp_plan

    cls = type(model)
    source = _REGISTERED.get(cls) or getattr(model, PLAN_ATTRIBUTE, None) or builtin_plan(model)
    if source is None and has_cp_plan(model):  # diffusers' own plan, read with the text whole
        source = plan_from_cp_plan
    if source is None:
        raise ValueError(
            f"optimization.parallel.sp_size or cp_size > 1 needs a sequence-parallel plan for "
            f"{cls.__name__}, and it has none: LiteGen has built-in plans for "
            f"{', '.join(builtin_names())}. Declare one on the class "
            f"({PLAN_ATTRIBUTE} = SequencePlan(split_inputs=..., gather_outputs=..., "
            "attention=...)) or call litegen.parallel.sequence.register_sequence_plan "
            "(docs/sequence_parallel.md)."
        )
    if isinstance(source, SequencePlan):
        plan = source
    elif getattr(source, "__self__", None) is model:  # a method: def litegen_sp_plan(self)
        plan = source()
    else:
        plan = source(model)
    plan.check(model)
    return plan


__all__ = [
    "BUILTIN",
    "builtin_names",
    "builtin_plan",
    "family_plans",
    "plan_for",
    "register_sequence_plan",
]
