"""The experimental switches, declared once: the torch each was tested on and where it hooks in.

Torch-free. ``ExperimentalConfig`` (``litegen.config``, which may not import this package) has
one field per row, off by default; ``tests/unit/test_experimental.py`` ties the two, and
docs/performance.md's table to :data:`litegen.experimental.TESTED_TORCH`, which is read from
here, as are the hooks :class:`litegen.experimental.Lab` installs.

Example:
    >>> [switch.name for switch in SWITCHES if switch.hook == "module_swap"]
    ['fused_gelu_mlp', 'fused_wan_attention']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The core's extension points a switch can plug into, and what ``Switch.target`` is for each:
# - module_swap: ``target(model) -> int`` swaps modules in place before checkpointing and
#   compile, returning how many it swapped;
# - block_context: ``target(value, compile_options)`` returns what every compiled block enters
#   around its calls (``litegen.compile.compile_blocks``'s ``block_contexts``);
# - master_step: ``target`` is the kernel that steps FP32 master weights
#   (``litegen.optim.set_master_step_kernel``).
Hook = Literal["module_swap", "block_context", "master_step"]


@dataclass(frozen=True)
class Switch:
    """One ``optimization.experimental`` field: its tested torch releases and its hook.

    ``target`` is ``"module:attribute"``, imported only when the switch is on and its torch
    release tested. A module swap also says what it swaps (``swaps``, for the log) and what a
    model it finds nothing in lacks (``absent``, for the warning).

    Example:
        >>> Switch("my_kernel", ("2.11",), "master_step", "litegen.experimental.mine:step").hook
        'master_step'
    """

    name: str
    tested_torch: tuple[str, ...]  # major.minor releases, tested on GPU
    hook: Hook
    target: str
    swaps: str = ""
    absent: str = ""


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "persistent_rows",
        ("2.11",),
        "block_context",
        "litegen.experimental.row_reductions:persistent_rows_context",
    ),
    Switch(
        "fused_gelu_mlp",
        ("2.11",),
        "module_swap",
        "litegen.experimental.fused_gelu_mlp:apply_fused_gelu_mlp",
        swaps="GELU MLPs",
        absent="no Linear-GELU(tanh)-Linear MLP that can be fused",
    ),
    Switch(
        "master_adamw",
        ("2.11",),
        "master_step",
        "litegen.experimental.master_adamw:one_pass_step",
    ),
    Switch(
        "fused_wan_attention",
        ("2.11",),
        "module_swap",
        "litegen.experimental.wan_attention:apply_fused_wan_attention",
        swaps="Wan self-attention layers",
        absent="no diffusers Wan self-attention layer",
    ),
)


def is_on(value: object) -> bool:
    """Whether a switch's config value turns it on: ``False`` and ``None`` are off.

    Example:
        >>> is_on(None), is_on(False), is_on(2048), is_on(True)
        (False, False, True, True)
    """
    return value is not None and value is not False


__all__ = ["SWITCHES", "Hook", "Switch", "is_on"]
