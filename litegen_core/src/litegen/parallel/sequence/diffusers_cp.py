"""A sequence-parallel plan read from a diffusers model's own context-parallel plan
(``_cp_plan``), for diffusers models LiteGen has no plan of (Flux, for one).

diffusers' plan names the tensors it splits and the output it gathers; LiteGen keeps the text
whole, so the entries that hold text are left out: arguments whose name starts with
``encoder_``, ``txt_`` or ``text``. Every attention module that is not cross-attention sees the
split tokens, after the text when the call joins text to them (``text_first``: the order of
diffusers' joint-attention transformers, Flux, SD3, Qwen-Image), or alone.

A plan read this way is checked like any other (paths, and the sequence length of every split
tensor at the first forward), so an entry that holds text under another name is an error, not
a wrong result. Tested on ``FluxTransformer2DModel``.

Example::

    plan = plan_from_cp_plan(flux)
    plan.split_inputs  # {'': {'hidden_states': Split(dim=1, ndim=3), 'img_ids': ...}}
"""

from __future__ import annotations

from torch import nn

from litegen.parallel.sequence.sequence_plan import SequencePlan, Split

CP_PLAN = "_cp_plan"
TEXT_PREFIXES = ("encoder_", "txt_", "text")


def has_cp_plan(model: nn.Module) -> bool:
    """Whether ``model`` is a diffusers model that carries a context-parallel plan."""
    return type(model).__module__.startswith("diffusers.") and bool(getattr(model, CP_PLAN, None))


def plan_from_cp_plan(model: nn.Module) -> SequencePlan:
    """The :class:`SequencePlan` that ``model``'s ``_cp_plan`` gives, with the text whole."""
    from diffusers.models._modeling_parallel import ContextParallelOutput

    split_inputs: dict[str, dict[str | int, Split]] = {}
    split_outputs: dict[str, dict[int, Split]] = {}
    gather_outputs: dict[str, int] = {}
    for path, entry in getattr(model, CP_PLAN).items():
        if isinstance(entry, ContextParallelOutput):
            gather_outputs[path] = entry.gather_dim
            continue
        for key, spec in entry.items():
            if isinstance(key, str) and key.startswith(TEXT_PREFIXES):
                continue
            split = Split(spec.split_dim, spec.expected_dims)
            if spec.split_output:
                split_outputs.setdefault(path, {})[int(key)] = split
            else:
                split_inputs.setdefault(path, {})[key] = split
    attention = {
        path: "text_first"
        for path, module in model.named_modules()
        if hasattr(module, "processor")
        and isinstance(getattr(module, "heads", None), int)
        and not getattr(module, "is_cross_attention", False)
    }
    return SequencePlan(split_inputs, split_outputs, gather_outputs, attention)


__all__ = ["has_cp_plan", "plan_from_cp_plan"]
