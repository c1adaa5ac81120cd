"""Find a model's repeated blocks: the units for activation checkpointing and FSDP wrapping.

A model may name them through ``get_fsdp_wrap_module_list()``; otherwise every ``ModuleList``
or ``Sequential`` (at any depth) whose children are two or more modules of one class counts,
for example the transformer blocks of a DiT, or the down and up stacks of a U-Net.
"""

from __future__ import annotations

from torch import nn

from litegen.model_parts.paths import is_under


def repeated_blocks(model: nn.Module) -> list[str]:
    """Dotted paths of the model's repeated blocks, in forward (registration) order.

    Example:
        >>> dit = nn.Module()
        >>> dit.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))
        >>> repeated_blocks(dit)
        ['blocks.0', 'blocks.1', 'blocks.2']
    """
    listed = getattr(model, "get_fsdp_wrap_module_list", None)
    if callable(listed):
        names = {id(module): name for name, module in model.named_modules()}
        chosen = list(listed())
        unknown = [type(m).__name__ for m in chosen if id(m) not in names]
        if unknown:
            raise ValueError(
                f"{type(model).__name__}.get_fsdp_wrap_module_list() returned modules that are "
                f"not submodules of the model: {unknown}; return modules of this model."
            )
        return [names[id(m)] for m in chosen]
    found: list[str] = []
    claimed: set[str] = set()
    for name, module in model.named_modules():
        if is_under(name, claimed):
            continue  # blocks nested inside a block already chosen are covered by it
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module.named_children())
        if len(children) >= 2 and len({type(child) for _, child in children}) == 1:
            # Leaf layers (Linear, activations) repeated in a Sequential are not blocks.
            if not any(True for _ in children[0][1].children()):
                continue
            prefix = f"{name}." if name else ""
            paths = [prefix + child_name for child_name, _ in children]
            found.extend(paths)
            claimed.update(paths)
    return found
