"""How a family's original checkpoint names the modules of its diffusers transformer: the
:class:`KeyMap` each family module declares as its ``original_keys``. Torch-free, so the family
registry loads without torch; :mod:`litegen.model_keys.original_format` holds the converters.

Each entry names a module of the original checkpoint and the diffusers modules whose output
rows it stacks, in the original's row order: one for a plain rename, several where the original
fuses projections into one Linear (Flux's ``double_blocks.{i}.img_attn.qkv`` is ``to_q``,
``to_k``, ``to_v`` stacked). ``{i}`` stands for a block index. A part ``module[k/n]`` is the
``k``-th of ``n`` equal row chunks of ``module``, for originals that order a module's rows
differently (Flux's final modulation holds shift then scale, diffusers' ``norm_out.linear``
scale then shift).

Example::

    KeyMap(modules={"blocks.{i}.self_attn.q": ("blocks.{i}.attn1.to_q",)})
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

_PART = re.compile(r"^(?P<module>[\w.{}]+?)(?:\[(?P<chunk>\d+)/(?P<of>\d+)\])?$")


@dataclass(frozen=True)
class KeyMap:
    """How one family's original checkpoint names the modules of its diffusers transformer.

    ``modules``: original module -> the diffusers modules (``part`` strings, see the module
    docstring) whose output rows it stacks, in order. Their ``.weight`` and ``.bias`` tensors
    and their LoRA adapters follow the module.
    ``tensors``: original tensor -> diffusers tensor, for tensors of no mapped module
    (modulation tables, norms whose leaf is named differently).
    ``lora_names``: the (down, up) names of LoRA files in the original layout.
    ``prefix``: the key prefix of LoRA files (ComfyUI's ``diffusion_model.``).
    ``scale_in_up``: originals whose LoRA is written without ``alpha``, its scale multiplied
    into the up matrix, where a reader refuses an alpha (ComfyUI reads a missing alpha as
    scale 1, so it reads both forms alike).

    Example::

        KeyMap(modules={"blocks.{i}.self_attn.q": ("blocks.{i}.attn1.to_q",)})
    """

    modules: Mapping[str, tuple[str, ...]]
    tensors: Mapping[str, str] = field(default_factory=dict)
    lora_names: tuple[str, str] = ("lora_A", "lora_B")
    prefix: str = "diffusion_model."
    scale_in_up: tuple[str, ...] = ()

    def find_original(self, module: str) -> tuple[str, tuple[Part, ...]] | None:
        """The original module holding the diffusers ``module`` and all its parts, or None.

        Example:
            >>> keys = KeyMap({"blocks.{i}.self_attn.q": ("blocks.{i}.attn1.to_q",)})
            >>> keys.find_original("blocks.3.attn1.to_q")
            ('blocks.3.self_attn.q', (Part(module='blocks.3.attn1.to_q', chunk=0, of=1),))
        """
        for original, parts in self.modules.items():
            for part in parts:
                match = compiled(parse_part(part).module).fullmatch(module)
                if match:
                    return fill(original, match), tuple(parse_part(fill(p, match)) for p in parts)
        return None

    def find_diffusers(self, original: str) -> tuple[Part, ...] | None:
        """The diffusers parts of the ``original`` module, or None when no entry names it.

        Example:
            >>> keys = KeyMap({"blocks.{i}.qkv": ("blocks.{i}.to_q", "blocks.{i}.to_k")})
            >>> [part.module for part in keys.find_diffusers("blocks.2.qkv")]
            ['blocks.2.to_q', 'blocks.2.to_k']
        """
        for pattern, parts in self.modules.items():
            match = compiled(pattern).fullmatch(original)
            if match:
                return tuple(parse_part(fill(p, match)) for p in parts)
        return None


class Part(NamedTuple):
    """Rows ``chunk`` of ``of`` equal chunks of the diffusers ``module``'s output."""

    module: str
    chunk: int = 0
    of: int = 1


def parse_part(part: str) -> Part:
    match = _PART.fullmatch(part)
    if match is None:
        raise ValueError(f"bad key-map part {part!r}: write 'module' or 'module[k/n]'.")
    if match["chunk"] is None:
        return Part(match["module"])
    return Part(match["module"], int(match["chunk"]), int(match["of"]))


@functools.cache
def compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)"))


def fill(pattern: str, match: re.Match[str]) -> str:
    return pattern.replace("{i}", match["i"]) if "{i}" in pattern else pattern


def lookup(name: str, pairs: Iterable[tuple[str, str]]) -> str | None:
    """The ``result`` of the first ``(pattern, result)`` whose pattern names ``name``."""
    for pattern, result in pairs:
        match = compiled(pattern).fullmatch(name)
        if match:
            return fill(result, match)
    return None
