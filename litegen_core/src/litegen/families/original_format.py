"""Key maps between diffusers' module names and the original checkpoints' names, and the
converters they drive: LoRA files that ComfyUI and diffusers' own converters read, and full
transformer weights as one original-format safetensors file.

A family states its map once, as one :class:`KeyMap` constant. Each entry names a module of the
original checkpoint and the diffusers modules whose output rows it stacks, in the original's
row order: one for a plain rename, several where the original fuses projections into one
Linear (Flux's ``double_blocks.{i}.img_attn.qkv`` is ``to_q``, ``to_k``, ``to_v`` stacked).
``{i}`` stands for a block index. A part ``module[k/n]`` is the ``k``-th of ``n`` equal row
chunks of ``module``, for originals that order a module's rows differently (Flux's final
modulation holds shift then scale, diffusers' ``norm_out.linear`` scale then shift).

LoRA files in the original layout key each adapter ``diffusion_model.<original module>.<down>
.weight``, ``.<up>.weight`` and ``.alpha`` (ComfyUI's layout; ``down``/``up`` are
``lora_A``/``lora_B`` or ``lora_down``/``lora_up``, per family). Adapters of modules the
original fuses become one adapter of the fused module, exactly: the down matrices stack along
the rank, the up matrices form a block-diagonal matrix (zero rows for a part without an
adapter) and alpha is set so that ``alpha / rank`` stays the trained scale. The inverse splits
such a block-diagonal adapter back into the parts' own adapters.

    from litegen.families.original_format import key_map_for, lora_to_original, output_rows

    original = lora_to_original(adapters, key_map_for("FluxTransformer2DModel"),
                                rows=output_rows(transformer))
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

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
            >>> WAN_KEY_MAP.find_original("blocks.3.attn1.to_q")
            ('blocks.3.self_attn.q', (Part(module='blocks.3.attn1.to_q', chunk=0, of=1),))
        """
        for original, parts in self.modules.items():
            for part in parts:
                match = _compiled(_parse(part).module).fullmatch(module)
                if match:
                    return _fill(original, match), tuple(_parse(_fill(p, match)) for p in parts)
        return None

    def find_diffusers(self, original: str) -> tuple[Part, ...] | None:
        """The diffusers parts of the ``original`` module, or None when no entry names it.

        Example:
            >>> [part.module for part in FLUX_KEY_MAP.find_diffusers("double_blocks.2.txt_attn.qkv")]
            ['transformer_blocks.2.attn.add_q_proj', 'transformer_blocks.2.attn.add_k_proj', 'transformer_blocks.2.attn.add_v_proj']
        """
        for pattern, parts in self.modules.items():
            match = _compiled(pattern).fullmatch(original)
            if match:
                return tuple(_parse(_fill(p, match)) for p in parts)
        return None


class Part(NamedTuple):
    """Rows ``chunk`` of ``of`` equal chunks of the diffusers ``module``'s output."""

    module: str
    chunk: int = 0
    of: int = 1


def _parse(part: str) -> Part:
    match = _PART.fullmatch(part)
    if match is None:
        raise ValueError(f"bad key-map part {part!r}: write 'module' or 'module[k/n]'.")
    if match["chunk"] is None:
        return Part(match["module"])
    return Part(match["module"], int(match["chunk"]), int(match["of"]))


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)"))


def _fill(pattern: str, match: re.Match[str]) -> str:
    return pattern.replace("{i}", match["i"]) if "{i}" in pattern else pattern


def _lookup(name: str, pairs: Iterable[tuple[str, str]]) -> str | None:
    """The ``result`` of the first ``(pattern, result)`` whose pattern names ``name``."""
    for pattern, result in pairs:
        match = _compiled(pattern).fullmatch(name)
        if match:
            return _fill(result, match)
    return None


def output_rows(model: nn.Module) -> dict[str, int]:
    """Each module's number of output rows (its weight's first dimension), by name: what the
    converters need to split a fused original module whose parts differ in size.

    Example:
        >>> output_rows(nn.Sequential(nn.Linear(3, 5)))
        {'0': 5}
    """
    return {
        name: module.weight.shape[0]
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() >= 1
    }


def _part_rows(parts: tuple[Part, ...], rows: Mapping[str, int] | None, what: str) -> list[int]:
    """Output rows of each part, from ``rows`` (module -> rows); chunks are equal splits."""
    missing = [p.module for p in parts if rows is None or p.module not in rows]
    if missing:
        raise ValueError(
            f"{what}: the sizes of {sorted(set(missing))} are needed to place their rows; pass "
            "rows=output_rows(transformer)."
        )
    assert rows is not None
    sizes = []
    for part in parts:
        total = rows[part.module]
        if total % part.of:
            raise ValueError(f"{what}: {part.module} has {total} rows, not {part.of} chunks.")
        sizes.append(total // part.of)
    return sizes


def _chunk(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    size = tensor.shape[0] // part.of
    return tensor[part.chunk * size : (part.chunk + 1) * size]


def _modules_of(parts: tuple[Part, ...]) -> list[str]:
    """The distinct modules of ``parts``, in order of first appearance."""
    return list(dict.fromkeys(p.module for p in parts))


def _unstack(
    tensor: torch.Tensor, parts: tuple[Part, ...], rows: Mapping[str, int] | None, what: str
) -> dict[str, torch.Tensor]:
    """The rows of a fused ``tensor`` given back to each module of ``parts``, in the module's
    own row order. Parts of one module split evenly; those of several need ``rows``."""
    if len(_modules_of(parts)) == 1:
        sizes = [tensor.shape[0] // p.of for p in parts]
    else:
        sizes = _part_rows(parts, rows, what)
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    row = 0
    for part, size in zip(parts, sizes, strict=True):
        pieces.setdefault(part.module, []).append((part.chunk, tensor[row : row + size]))
        row += size
    return {
        module: torch.cat([block for _, block in sorted(blocks, key=lambda item: item[0])])
        for module, blocks in pieces.items()
    }


# -- LoRA ------------------------------------------------------------------------------------
class _Adapter(NamedTuple):
    down: torch.Tensor  # lora_A: (rank, in, ...)
    up: torch.Tensor  # lora_B: (out, rank, ...)
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.down.shape[0]


def _adapters(state: Mapping[str, torch.Tensor], names: tuple[str, str]) -> dict[str, _Adapter]:
    """``<module>.<down>.weight``, ``.<up>.weight`` and optional ``.alpha`` keys, by module."""
    down, up = names
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        for suffix in (f"{down}.weight", f"{up}.weight", "alpha"):
            if key.endswith(f".{suffix}"):
                modules.setdefault(key[: -len(suffix) - 1], {})[suffix] = value
                break
        else:
            raise ValueError(
                f"LoRA key {key!r} is not <module>.{down}.weight, .{up}.weight or .alpha; "
                "LoRA biases and other adapter kinds have no original-format form here."
            )
    adapters = {}
    for module, tensors in modules.items():
        if f"{down}.weight" not in tensors or f"{up}.weight" not in tensors:
            raise ValueError(f"LoRA of {module} lacks its {down} or {up} weight.")
        a, b = tensors[f"{down}.weight"], tensors[f"{up}.weight"]
        alpha = float(tensors["alpha"]) if "alpha" in tensors else float(a.shape[0])
        adapters[module] = _Adapter(a, b, alpha)
    return adapters


def _lora_keys(module: str, adapter: _Adapter, names: tuple[str, str]) -> dict[str, torch.Tensor]:
    down, up = names
    return {
        f"{module}.{down}.weight": adapter.down,
        f"{module}.{up}.weight": adapter.up,
        f"{module}.alpha": torch.tensor(adapter.alpha, dtype=torch.float32),
    }


def lora_to_original(
    lora: Mapping[str, torch.Tensor],
    key_map: KeyMap,
    *,
    rows: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """LoRA adapters keyed by diffusers modules -> the original layout, ``key_map.prefix``
    included. ``lora`` holds ``<module>.lora_A.weight``, ``<module>.lora_B.weight`` and
    optionally ``<module>.alpha`` (default: the rank) per module, no file prefix. ``rows``
    (:func:`output_rows` of the transformer) is needed where a fused original module has a
    part without an adapter. Raises ``ValueError`` naming a module the original lacks.

    Example::

        original = lora_to_original(
            {"blocks.0.attn1.to_q.lora_A.weight": a, "blocks.0.attn1.to_q.lora_B.weight": b},
            WAN_KEY_MAP)   # {"diffusion_model.blocks.0.self_attn.q.lora_A.weight": a, ...}
    """
    grouped: dict[str, tuple[tuple[Part, ...], dict[str, _Adapter]]] = {}
    for module, adapter in _adapters(lora, ("lora_A", "lora_B")).items():
        found = key_map.find_original(module)
        if found is None:
            raise ValueError(
                f"the original checkpoint has no module for the LoRA of {module}; leave it out "
                "of optimization.lora.target_modules to export the original format."
            )
        original, parts = found
        grouped.setdefault(original, (parts, {}))[1][module] = adapter
    out = {}
    for original, (parts, adapters) in grouped.items():
        fused = _fuse(original, parts, adapters, rows)
        keys = _lora_keys(original, fused, key_map.lora_names)
        if any(_compiled(p).fullmatch(original) for p in key_map.scale_in_up):
            del keys[f"{original}.alpha"]
            up = f"{original}.{key_map.lora_names[1]}.weight"
            keys[up] = keys[up] * fused.scale
        out.update({f"{key_map.prefix}{k}": v for k, v in keys.items()})
    return out


def _fuse(
    original: str,
    parts: tuple[Part, ...],
    adapters: Mapping[str, _Adapter],
    rows: Mapping[str, int] | None,
) -> _Adapter:
    """One adapter of ``original`` equal to the parts' adapters side by side."""
    modules = [m for m in _modules_of(parts) if m in adapters]
    if len(parts) == 1:
        return adapters[modules[0]]
    scale = adapters[modules[0]].scale
    down = torch.cat([adapters[m].down for m in modules])
    rank_start, start = {}, 0
    for m in modules:
        rank_start[m] = start
        start += adapters[m].down.shape[0]
    if all(p.module in adapters for p in parts):
        sizes = [adapters[p.module].up.shape[0] // p.of for p in parts]
    else:
        sizes = _part_rows(parts, rows, f"LoRA of {original}")
    first = adapters[modules[0]].up
    up = first.new_zeros((sum(sizes), down.shape[0], *first.shape[2:]))
    row = 0
    for part, size in zip(parts, sizes, strict=True):
        adapter = adapters.get(part.module)
        if adapter is not None:
            r, col = adapter.down.shape[0], rank_start[part.module]
            block = _chunk(adapter.up, part)
            ratio = adapter.scale / scale
            up[row : row + size, col : col + r] = block * ratio if ratio != 1.0 else block
        row += size
    return _Adapter(down, up, scale * down.shape[0])


def lora_from_original(
    state: Mapping[str, torch.Tensor],
    key_map: KeyMap,
    *,
    rows: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """A LoRA file in the original layout -> adapters keyed by diffusers modules
    (``<module>.lora_A.weight``, ``.lora_B.weight``, ``.alpha``; no file prefix).

    A fused adapter splits into its parts' own, of equal ranks, where its up matrix is block
    diagonal (as :func:`lora_to_original` writes it); otherwise every part gets the whole down
    matrix and its rows of the up matrix (exact too, at the fused rank). ``rows``
    (:func:`output_rows`) is needed to split a fused module of several diffusers modules.

    Example::

        adapters = lora_from_original(load_file("run.original.lora.safetensors"),
                                      FLUX_KEY_MAP, rows=output_rows(transformer))
    """
    unprefixed = {}
    for key, value in state.items():
        if not key.startswith(key_map.prefix):
            raise ValueError(f"LoRA key {key!r} lacks the prefix {key_map.prefix!r}.")
        unprefixed[key[len(key_map.prefix) :]] = value
    out = {}
    for original, adapter in _adapters(unprefixed, key_map.lora_names).items():
        parts = key_map.find_diffusers(original)
        if parts is None:
            raise ValueError(f"no diffusers module is known for the original module {original}.")
        for module, split in _split(original, parts, adapter, rows).items():
            out.update(_lora_keys(module, split, ("lora_A", "lora_B")))
    return out


def _split(
    original: str, parts: tuple[Part, ...], adapter: _Adapter, rows: Mapping[str, int] | None
) -> dict[str, _Adapter]:
    modules = _modules_of(parts)
    if len(parts) == 1:
        return {modules[0]: adapter}
    ups = _unstack(adapter.up, parts, rows, f"LoRA of {original}")
    rank = adapter.down.shape[0]
    if rank % len(modules) == 0 and _block_diagonal(ups, modules, rank // len(modules)):
        r = rank // len(modules)
        return {
            m: _Adapter(
                adapter.down[i * r : (i + 1) * r],
                ups[m][:, i * r : (i + 1) * r],
                adapter.scale * r,
            )
            for i, m in enumerate(modules)
        }
    return {m: _Adapter(adapter.down, ups[m], adapter.alpha) for m in modules}


def _block_diagonal(ups: Mapping[str, torch.Tensor], modules: list[str], r: int) -> bool:
    for i, m in enumerate(modules):
        outside = torch.cat([ups[m][:, : i * r], ups[m][:, (i + 1) * r :]], dim=1)
        if outside.count_nonzero():
            return False
    return True


# -- full weights ----------------------------------------------------------------------------
def weights_to_original(
    state: Mapping[str, torch.Tensor], key_map: KeyMap
) -> dict[str, torch.Tensor]:
    """A diffusers transformer's full state dict -> the original checkpoint's keys (no
    prefix, as the original releases are written), fused modules concatenated. Raises
    ``ValueError`` listing the tensors the map does not place.

    Example::

        save_file(weights_to_original(transformer.state_dict(), WAN_KEY_MAP), "wan.safetensors")
    """
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, tuple[tuple[Part, ...], str]] = {}
    unplaced = []
    for name, tensor in state.items():
        renamed = _lookup(name, ((d, o) for o, d in key_map.tensors.items()))
        if renamed is not None:
            out[renamed] = tensor
            continue
        module, _, leaf = name.rpartition(".")
        found = key_map.find_original(module)
        if found is None:
            unplaced.append(name)
        elif len(found[1]) == 1 and found[1][0].of == 1:
            out[f"{found[0]}.{leaf}"] = tensor
        else:
            fused[f"{found[0]}.{leaf}"] = (found[1], leaf)
    if unplaced:
        raise ValueError(
            f"the original-format key map places no tensor named {unplaced[:5]} "
            f"({len(unplaced)} in all); add them to the family's KeyMap."
        )
    for original, (parts, leaf) in fused.items():
        out[original] = torch.cat([_chunk(state[f"{p.module}.{leaf}"], p) for p in parts])
    return out


def weights_from_original(
    state: Mapping[str, torch.Tensor], key_map: KeyMap, *, rows: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`weights_to_original`: an original checkpoint's tensors keyed
    like the diffusers transformer's state dict. ``rows``: :func:`output_rows` of it.

    Example::

        transformer.load_state_dict(weights_from_original(load_file(path), FLUX_KEY_MAP,
                                                          rows=output_rows(transformer)))
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        matched = _lookup(name, key_map.tensors.items())
        if matched is not None:
            out[matched] = tensor
            continue
        module, _, leaf = name.rpartition(".")
        parts = key_map.find_diffusers(module)
        if parts is None:
            raise ValueError(f"no diffusers tensor is known for the original tensor {name}.")
        pieces = _unstack(tensor, parts, rows, f"original tensor {name}")
        out.update({f"{module}.{leaf}": piece for module, piece in pieces.items()})
    return out


# -- families --------------------------------------------------------------------------------
# Wan 2.1 / 2.2 (WanTransformer3DModel) as Wan-AI's checkpoints name it; q, k and v stay
# separate there. The image-to-video models add k_img/v_img/norm_k_img and the image embedder.
# diffusers' converter takes alpha inside the blocks only and refuses it elsewhere.
WAN_KEY_MAP = KeyMap(
    modules={
        "patch_embedding": ("patch_embedding",),
        "time_embedding.0": ("condition_embedder.time_embedder.linear_1",),
        "time_embedding.2": ("condition_embedder.time_embedder.linear_2",),
        "time_projection.1": ("condition_embedder.time_proj",),
        "text_embedding.0": ("condition_embedder.text_embedder.linear_1",),
        "text_embedding.2": ("condition_embedder.text_embedder.linear_2",),
        "img_emb.proj.0": ("condition_embedder.image_embedder.norm1",),
        "img_emb.proj.1": ("condition_embedder.image_embedder.ff.net.0.proj",),
        "img_emb.proj.3": ("condition_embedder.image_embedder.ff.net.2",),
        "img_emb.proj.4": ("condition_embedder.image_embedder.norm2",),
        "blocks.{i}.self_attn.q": ("blocks.{i}.attn1.to_q",),
        "blocks.{i}.self_attn.k": ("blocks.{i}.attn1.to_k",),
        "blocks.{i}.self_attn.v": ("blocks.{i}.attn1.to_v",),
        "blocks.{i}.self_attn.o": ("blocks.{i}.attn1.to_out.0",),
        "blocks.{i}.self_attn.norm_q": ("blocks.{i}.attn1.norm_q",),
        "blocks.{i}.self_attn.norm_k": ("blocks.{i}.attn1.norm_k",),
        "blocks.{i}.cross_attn.q": ("blocks.{i}.attn2.to_q",),
        "blocks.{i}.cross_attn.k": ("blocks.{i}.attn2.to_k",),
        "blocks.{i}.cross_attn.v": ("blocks.{i}.attn2.to_v",),
        "blocks.{i}.cross_attn.o": ("blocks.{i}.attn2.to_out.0",),
        "blocks.{i}.cross_attn.norm_q": ("blocks.{i}.attn2.norm_q",),
        "blocks.{i}.cross_attn.norm_k": ("blocks.{i}.attn2.norm_k",),
        "blocks.{i}.cross_attn.k_img": ("blocks.{i}.attn2.add_k_proj",),
        "blocks.{i}.cross_attn.v_img": ("blocks.{i}.attn2.add_v_proj",),
        "blocks.{i}.cross_attn.norm_k_img": ("blocks.{i}.attn2.norm_added_k",),
        "blocks.{i}.norm3": ("blocks.{i}.norm2",),  # the cross-attention norm
        "blocks.{i}.ffn.0": ("blocks.{i}.ffn.net.0.proj",),
        "blocks.{i}.ffn.2": ("blocks.{i}.ffn.net.2",),
        "head.head": ("proj_out",),
    },
    tensors={
        "head.modulation": "scale_shift_table",
        "blocks.{i}.modulation": "blocks.{i}.scale_shift_table",
        "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed",  # first-last frame
    },
    scale_in_up=(
        "patch_embedding",
        "time_embedding.0",
        "time_embedding.2",
        "time_projection.1",
        "text_embedding.0",
        "text_embedding.2",
        "img_emb.proj.1",
        "img_emb.proj.3",
        "head.head",
    ),
)

# Flux.1 (FluxTransformer2DModel) as Black Forest Labs' checkpoints name it. diffusers reads
# LoRAs under this prefix only with lora_down/lora_up names (its sd-scripts converter);
# ComfyUI reads those names too.
FLUX_KEY_MAP = KeyMap(
    modules={
        "img_in": ("x_embedder",),
        "txt_in": ("context_embedder",),
        "time_in.in_layer": ("time_text_embed.timestep_embedder.linear_1",),
        "time_in.out_layer": ("time_text_embed.timestep_embedder.linear_2",),
        "guidance_in.in_layer": ("time_text_embed.guidance_embedder.linear_1",),
        "guidance_in.out_layer": ("time_text_embed.guidance_embedder.linear_2",),
        "vector_in.in_layer": ("time_text_embed.text_embedder.linear_1",),
        "vector_in.out_layer": ("time_text_embed.text_embedder.linear_2",),
        "double_blocks.{i}.img_mod.lin": ("transformer_blocks.{i}.norm1.linear",),
        "double_blocks.{i}.txt_mod.lin": ("transformer_blocks.{i}.norm1_context.linear",),
        "double_blocks.{i}.img_attn.qkv": (
            "transformer_blocks.{i}.attn.to_q",
            "transformer_blocks.{i}.attn.to_k",
            "transformer_blocks.{i}.attn.to_v",
        ),
        "double_blocks.{i}.txt_attn.qkv": (
            "transformer_blocks.{i}.attn.add_q_proj",
            "transformer_blocks.{i}.attn.add_k_proj",
            "transformer_blocks.{i}.attn.add_v_proj",
        ),
        "double_blocks.{i}.img_attn.proj": ("transformer_blocks.{i}.attn.to_out.0",),
        "double_blocks.{i}.txt_attn.proj": ("transformer_blocks.{i}.attn.to_add_out",),
        "double_blocks.{i}.img_mlp.0": ("transformer_blocks.{i}.ff.net.0.proj",),
        "double_blocks.{i}.img_mlp.2": ("transformer_blocks.{i}.ff.net.2",),
        "double_blocks.{i}.txt_mlp.0": ("transformer_blocks.{i}.ff_context.net.0.proj",),
        "double_blocks.{i}.txt_mlp.2": ("transformer_blocks.{i}.ff_context.net.2",),
        "single_blocks.{i}.modulation.lin": ("single_transformer_blocks.{i}.norm.linear",),
        "single_blocks.{i}.linear1": (
            "single_transformer_blocks.{i}.attn.to_q",
            "single_transformer_blocks.{i}.attn.to_k",
            "single_transformer_blocks.{i}.attn.to_v",
            "single_transformer_blocks.{i}.proj_mlp",
        ),
        "single_blocks.{i}.linear2": ("single_transformer_blocks.{i}.proj_out",),
        "final_layer.linear": ("proj_out",),
        # BFL's final modulation is (shift, scale); diffusers' norm_out.linear (scale, shift).
        "final_layer.adaLN_modulation.1": ("norm_out.linear[1/2]", "norm_out.linear[0/2]"),
    },
    tensors={
        "double_blocks.{i}.img_attn.norm.query_norm.scale": "transformer_blocks.{i}.attn.norm_q.weight",
        "double_blocks.{i}.img_attn.norm.key_norm.scale": "transformer_blocks.{i}.attn.norm_k.weight",
        "double_blocks.{i}.txt_attn.norm.query_norm.scale": (
            "transformer_blocks.{i}.attn.norm_added_q.weight"
        ),
        "double_blocks.{i}.txt_attn.norm.key_norm.scale": (
            "transformer_blocks.{i}.attn.norm_added_k.weight"
        ),
        "single_blocks.{i}.norm.query_norm.scale": "single_transformer_blocks.{i}.attn.norm_q.weight",
        "single_blocks.{i}.norm.key_norm.scale": "single_transformer_blocks.{i}.attn.norm_k.weight",
    },
    lora_names=("lora_down", "lora_up"),
)

KEY_MAPS: dict[str, KeyMap] = {
    "WanTransformer3DModel": WAN_KEY_MAP,
    "FluxTransformer2DModel": FLUX_KEY_MAP,
}


def key_map_for(transformer: str | nn.Module) -> KeyMap | None:
    """The key map of a transformer class (its name, or a model), or None when its original
    format is not known.

    Example:
        >>> key_map_for("FluxTransformer2DModel").lora_names
        ('lora_down', 'lora_up')
    """
    name = transformer if isinstance(transformer, str) else type(transformer).__name__
    return KEY_MAPS.get(name)
