"""ZeRO optimizer state on disk and across world sizes: pieces, full states, shard files.

A rank's optimizer state is a list of *pieces*: a contiguous range ``[start, start + numel)``
of one flattened parameter (named by FQN), with the per-element state tensors of that range
(``flat``) and the per-parameter values (``scalar``, such as ``step``). Pieces do not depend
on the bucket layout or the world size, so any set of them that covers the parameters can be
turned into the full state (keyed by FQN, like ``get_optimizer_state_dict(full_state_dict=
True)``) and cut again for another layout. The sharded file format (:class:`ZeroShards`) is one
``torch.save`` file of pieces per rank plus a small JSON manifest at the requested path.

Example::

    full = full_from_pieces([rank0_pieces, rank1_pieces], shapes)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from litegen.checkpoint.atomic import atomic_write_text
from litegen.checkpoint.files import load_state, save_state
from litegen.checkpoint.formats import StateFormat
from litegen.checkpoint.manifest import is_json, read_manifest

MANIFEST_FORMAT = "litegen.zero.sharded_optimizer"
Piece = dict[str, Any]


def make_piece(fqn: str, start: int, numel: int, flat: dict, scalar: dict) -> Piece:
    """A piece with its tensors detached onto the CPU (so it can be saved or sent)."""
    return {
        "fqn": fqn,
        "start": start,
        "numel": numel,
        "flat": {k: v.detach().to("cpu", copy=True) for k, v in flat.items()},
        "scalar": {
            k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in scalar.items()
        },
    }


def split_state(state: dict, numel: int) -> tuple[dict, dict]:
    """Per-element tensors (one value per parameter element) apart from per-parameter values."""
    flat, scalar = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel:
            flat[key] = value.reshape(-1)
        else:
            scalar[key] = value
    return flat, scalar


def full_from_pieces(pieces: Iterable[Piece], shapes: dict[str, list[int]]) -> dict[str, dict]:
    """Assemble ``{fqn: {key: tensor shaped like the parameter}}`` from pieces of any ranks."""
    state: dict[str, dict] = {}
    for piece in pieces:
        fqn = piece["fqn"]
        shape = shapes[fqn]
        entry = state.setdefault(fqn, {})
        for key, value in piece["scalar"].items():
            entry.setdefault(key, value)
        for key, value in piece["flat"].items():
            if key not in entry:
                entry[key] = torch.zeros(shape, dtype=value.dtype)
            start = piece["start"]
            entry[key].view(-1)[start : start + piece["numel"]] = value
    return state


def full_state(state: dict[str, dict], groups: list[dict]) -> dict[str, Any]:
    """The torch full-state layout: ``{"state": {fqn: ...}, "param_groups": [...]}``."""
    return {"state": state, "param_groups": groups}


def hyperparameters(group: dict, fqns: list[str]) -> dict:
    """One param group's settings with its parameters named by FQN."""
    return {**{k: v for k, v in group.items() if k != "params"}, "params": list(fqns)}


def load_hyperparameters(param_groups: list[dict], saved: list[dict]) -> None:
    """Copy saved group settings (lr, betas, ...) onto the live groups, matched by position."""
    if len(saved) != len(param_groups):
        raise ValueError(
            f"the optimizer state has {len(saved)} param groups but the optimizer has "
            f"{len(param_groups)}; build the optimizer with the same groups as the saved run."
        )
    for group, saved_group in zip(param_groups, saved, strict=True):
        for key, value in saved_group.items():
            if key != "params":
                # JSON (the manifest) turns tuples such as Adam's betas into lists.
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


# -- files ------------------------------------------------------------------------------------
def shard_name(path: Path, rank: int, world_size: int) -> str:
    return f"{path.name}.shard{rank:05d}-of-{world_size:05d}"


def save_sharded(
    path: Path,
    pieces: list[Piece],
    *,
    shapes: dict[str, list[int]],
    groups: list[dict],
    strategy: str,
) -> Path:
    """Every rank writes its pieces; rank 0 then writes the manifest at ``path``. Collective.

    The manifest is written last, so a crash mid-save never leaves a manifest that names
    missing shards.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    save_state({"pieces": pieces}, path.with_name(shard_name(path, rank, world)))
    dist.barrier()
    if rank == 0:
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "strategy": strategy,
            "world_size": world,
            "shards": [shard_name(path, r, world) for r in range(world)],
            "shapes": shapes,
            "param_groups": groups,
        }
        atomic_write_text(path, json.dumps(manifest, indent=1))
    dist.barrier()
    return path


class ZeroShards(StateFormat):
    """ZeRO's sharded optimizer state: a JSON manifest at the path, one shard file per rank
    beside it (saved at any world size). Written by :func:`save_sharded`, a collective."""

    name = "zero_sharded"
    holds: ClassVar[tuple[str, ...]] = ("optimizer",)
    manifest_tag = MANIFEST_FORMAT

    def recognizes(self, path: Path) -> bool:
        return is_json(path)

    def read(self, path: Path, what: str) -> dict[str, Any]:
        """Every rank reads the shards and assembles the whole state on the CPU, then keeps
        what its own layout needs; this is what makes a 4-rank save load into 2 ranks."""
        try:
            manifest = read_manifest(path, {"format": self.manifest_tag})
        except ValueError:
            raise ValueError(
                f"{path} is JSON but not a LiteGen sharded optimizer manifest."
            ) from None
        pieces: list[Piece] = []
        for name in manifest["shards"]:
            shard_path = path.with_name(name)
            if not shard_path.is_file():
                raise FileNotFoundError(
                    f"optimizer shard {shard_path} named by the manifest {path} is missing; copy "
                    f"all {manifest['world_size']} shard files next to the manifest."
                )
            pieces.extend(load_state(shard_path, what=f"{what} shard")["pieces"])
        state = full_from_pieces(pieces, manifest["shapes"])
        return full_state(state, manifest["param_groups"])


def load_optimizer_state(path: Path) -> dict[str, Any]:
    """The full optimizer state from a manifest + shards (any world size) or one full file.

    Example::

        state = load_optimizer_state(Path("ckpt/dit.optim_state.pth"))
    """
    return load_state(path, what="optimizer", holding="optimizer")
