"""scripts/lab/compile_grad_check.py: compiled blocks' gradients against eager ones."""

import argparse

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from scripts.lab.compile_grad_check import difference, train


def _args(backend) -> argparse.Namespace:
    return argparse.Namespace(
        model="dit",
        device="cpu",
        tiny=True,
        frames=None,
        steps=2,
        lr=1e-3,
        backend=backend,
        part="",
        fp32=False,
    )


def _doubles_gradients(gm, _):
    def run(*args):
        return [o * 2 if isinstance(o, torch.Tensor) else o for o in gm(*args)]

    return make_boxed_func(run)


def test_sound_compiled_blocks_match_eager_and_wrong_gradients_are_caught():
    eager = train(_args("aot_eager"), "eager")
    for side in ("hand", "litegen"):
        sound = train(_args("aot_eager"), side)
        assert difference(sound["grads"], eager["grads"]) < 1e-5
        assert sound["loss"] == torch.tensor(eager["loss"]).tolist()
    broken = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=_doubles_gradients
    )
    for side in ("hand", "litegen"):
        wrong = train(_args(broken), side)
        assert difference(wrong["grads"], eager["grads"]) > 0.1  # the blocks' share doubled
