"""The plain PyTorch loop a user would write, run on a LiteGen recipe's entry module.

The reference that ``litegen launch`` is measured against (``launch_vs_hand.py``): the same
``build(config)`` (model, optimizer, dataset) and ``train_step``, driven by a DataLoader over the
same dataset and batch size, with the recipe's autocast, gradient clipping, regional compile
(``torch.compile`` of each block's ``forward`` in place, with the inductor options correct
gradients need, ``litegen.compile.correct_gradient_options``) and logging cadence
(``loss.item()`` every ``trainer.log_every`` steps). No LiteGen code runs in the loop.

Each step's end is timed without a host sync (a CUDA event, or the host clock on CPU), and
``<results_dir>/metrics.jsonl`` gets one record per step in the trainer's format (``step``,
``time`` when it ended, ``samples_per_s``, and ``loss`` on logged steps). ``train_step`` also gets ``config`` and
``step`` (the steps done before it), and the entry's ``finish`` runs at the end, both as
``litegen launch`` passes them, so the entry module may take them (with ``**_`` for the rest).

    python -m scripts.bench.hand_loop RECIPE.yaml [KEY=VALUE ...]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from litegen.compile import correct_gradient_options
from litegen.entry import load_entry
from litegen_cli.recipe import load_recipe

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compile_blocks_by_hand(model: nn.Module, dynamic: bool | None) -> int:
    """``torch.compile`` the ``forward`` of every block in the model's block lists, in place."""
    count = 0
    options = correct_gradient_options()
    for child in model.children():
        if isinstance(child, nn.ModuleList) and len(child) > 1:
            for block in child:
                block.forward = torch.compile(block.forward, dynamic=dynamic, options=options)
                count += 1
    return count


class StepClock:
    """Wall times of step ends: CUDA events (read once, at the end) or the host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)  # the first event's wall time is now
        self.origin = time.time()
        self.marks: list[Any] = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.time())

    def times(self) -> list[float]:
        """Wall time of each mark after the first (the start), in order."""
        if not self.cuda:
            return self.marks[1:]
        self.marks[-1].synchronize()
        first = self.marks[0]
        return [self.origin + first.elapsed_time(event) / 1e3 for event in self.marks[1:]]


def forever(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def train(config: Any, module: Any) -> list[dict[str, Any]]:
    """The loop; returns one record per step."""
    device = torch.device(config.runtime.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    torch.manual_seed(config.global_seed)
    parts = module.build(config)
    model, optimizer, dataset = parts["model"], parts["optimizer"], parts["dataset"]
    model.to(device).train()
    if config.optimization.compile.enabled:
        compile_blocks_by_hand(model, config.optimization.compile.dynamic)
    loader = DataLoader(
        dataset,
        batch_size=config.global_batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=config.num_workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(config.global_seed),
        collate_fn=getattr(dataset, "collate_fn", None),
    )
    trainer = config.trainer
    dtype = AUTOCAST.get(trainer.autocast)
    batches = forever(loader)
    losses: dict[int, float] = {}
    clock = StepClock(device)
    for step in range(1, config.max_steps + 1):
        batch = to_device(next(batches), device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = module.train_step(batch, **parts, config=config, step=step - 1)
        loss.backward()
        if trainer.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), trainer.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.mark()
        if step % trainer.log_every == 0 or step == config.max_steps:
            losses[step] = loss.item()
    records = []
    ends = clock.times()
    for step, (start, end) in enumerate(pairwise([clock.origin, *ends]), start=1):
        record = {
            "step": step,
            "time": end,
            "samples_per_s": config.global_batch_size / (end - start),
        }
        if step in losses:
            record["loss"] = losses[step]
        records.append(record)
    finish = getattr(module, "finish", None)
    if callable(finish):
        finish(**parts, config=config, step=config.max_steps)
    return records


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m scripts.bench.hand_loop RECIPE.yaml [KEY=VALUE ...]")
    recipe = load_recipe(Path(argv[0]), argv[1:])
    module = load_entry(recipe.launch.entry, recipe.base_dir)
    records = train(recipe.config, module)
    results = Path(recipe.config.get_results_dir())
    results.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (results / "metrics.jsonl").write_text(lines, encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
