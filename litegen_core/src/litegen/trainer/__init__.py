"""The training loop that ``litegen launch`` runs around a user's ``train_step``.

Library users can run it too::

    gen = litegen.initialize(config)
    parts = dict(zip(("model", "optimizer", "loader"), gen.prepare(model, optimizer, dataset)))
    Trainer(gen, train_step, parts, sample_fn=sample).fit()

``train_step(batch, **parts)`` returns the loss of one micro-batch. It receives, by keyword,
whichever of the prepared parts, ``gen``, ``config`` and ``step`` its signature asks for (or all
of them through ``**kwargs``). The optional ``sample`` and ``validate`` hooks are in
:mod:`litegen.trainer.hooks`, the profiler in :mod:`litegen.trainer.profiling`.
"""

from litegen.trainer.entry_run import run_entry
from litegen.trainer.hooks import TrainingHooks, ema_weights
from litegen.trainer.loop import StepResult, Trainer
from litegen.trainer.sample_files import save_samples

__all__ = ["StepResult", "Trainer", "TrainingHooks", "ema_weights", "run_entry", "save_samples"]
