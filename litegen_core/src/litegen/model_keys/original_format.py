"""Key maps between diffusers' module names and the original checkpoints' names, and the
converters they drive: LoRA files that ComfyUI and diffusers' own converters read, and full
transformer weights as one original-format safetensors file.

A family states its map once, as one :class:`~litegen.model_keys.key_map.KeyMap` (its
``original_keys``). Each entry names a module of the
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

    from litegen.families import key_map_for
    from litegen.model_keys.original_format import lora_to_original, output_rows

    original = lora_to_original(adapters, key_map_for("FluxTransformer2DModel"),
                                rows=output_rows(transformer))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from litegen.model_keys.key_map import KeyMap, Part, compiled, lookup


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
            Wan.original_keys)   # {"diffusion_model.blocks.0.self_attn.q.lora_A.weight": a, ...}
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
        if any(compiled(p).fullmatch(original) for p in key_map.scale_in_up):
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
                                      Flux.original_keys, rows=output_rows(transformer))
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

        save_file(weights_to_original(transformer.state_dict(), Wan.original_keys), "wan.safetensors")
    """
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, tuple[tuple[Part, ...], str]] = {}
    unplaced = []
    for name, tensor in state.items():
        renamed = lookup(name, ((d, o) for o, d in key_map.tensors.items()))
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

        transformer.load_state_dict(weights_from_original(load_file(path), Flux.original_keys,
                                                          rows=output_rows(transformer)))
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        matched = lookup(name, key_map.tensors.items())
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
