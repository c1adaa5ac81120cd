"""One trainable model as a run checkpoint sees it: the sharded state DCP saves and loads in place.

Example::

    Trainable(model, optimizer, strategy).load("results/dit/step_100/model_0")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Trainable:
    """One trainable model as checkpoints see it: its strategy's sharded state, the optimizer's,
    and the EMA's when it goes with this model.

    ``strategy`` is the model's :class:`litegen.parallel.base.Strategy` (its ``dcp_state`` and
    ``load_dcp_state``); ``ema`` an EMA with ``dcp_state``/``load_dcp_state``, or None.

    Example::

        Trainable(model, optimizer, strategy, ema=None).dcp_state().keys()
    """

    module: Any
    optimizer: Any
    strategy: Any
    ema: Any = None

    def dcp_state(self) -> dict[str, Any]:
        """The state ``torch.distributed.checkpoint`` saves, and loads in place."""
        state = self.strategy.dcp_state(self.module, self.optimizer)
        if self.ema is not None:
            state["ema"] = self.ema.dcp_state()
        return state

    # torch.distributed.checkpoint.stateful.Stateful: a trainable model is one stateful part.
    def state_dict(self) -> dict[str, Any]:
        return self.dcp_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_dcp_state(state)

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        """Apply a state :meth:`dcp_state` returned and ``dcp.load`` filled."""
        self.strategy.load_dcp_state(self.module, self.optimizer, state)
        if self.ema is not None:
            self.ema.load_dcp_state(state["ema"])

    def load(self, checkpoint_id: str | Path) -> None:
        """Load the DCP folder ``checkpoint_id`` into the model (optimizer, EMA) in place.

        Example::

            Trainable(model, optimizer, strategy).load("ckpt/step_100/model_0")
        """
        import torch.distributed.checkpoint as dcp

        from litegen.checkpoint.dcp_reader import CheckedLoadPlanner, CheckedReader

        state = self.dcp_state()
        # FSDP1 chunks each parameter on dim 0, so a rank past that dim's size (Wan's
        # (1, 6, dim) scale_shift_table on rank 1) holds a ShardedTensor with no local shard.
        # DCP's default planner drops those while flattening nested ShardedTensors, then reads
        # the checkpoint keys it no longer sees as a pre-2.4 layout and asks for keys never
        # written. LiteGen never nests ShardedTensors (that is FSDP1 with tensor parallelism),
        # so the flattening is off.
        # The checked reader and planner unpickle nothing but DCP's metadata and plain values.
        planner = CheckedLoadPlanner(flatten_sharded_tensors=False)
        dcp.load(state, storage_reader=CheckedReader(checkpoint_id), planner=planner)
        self.load_dcp_state(state)

    def model_shapes(self) -> dict[str, Any]:
        """The model's tensors at their global shapes (to check a checkpoint against)."""
        return self.strategy.dcp_state(self.module)["model"]
