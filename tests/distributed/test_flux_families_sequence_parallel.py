"""Flux.2 and Flux.1 Kontext under sequence parallelism on 2 gloo CPU ranks: each family's
training forward through the plan read from diffusers' ``_cp_plan`` (the text whole on every
rank, the image tokens split, joint attention text first) gives one process's prediction and
gradients, at token counts that leave padding, with a reference image whose tokens are split
with the target's."""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.distributed.harness import run_ranks

pytest.importorskip("diffusers")

FAMILIES = ("flux2", "flux_kontext")


def one_step(name: str, sp: int) -> dict:
    import diffusers

    import litegen
    from litegen.families import family_named
    from litegen.utils.config import MainConfig

    family = family_named(name)

    def build():
        torch.manual_seed(0)
        return getattr(diffusers, family.transformer_class)(**family.tiny_config)

    generator = torch.Generator().manual_seed(1)
    noisy = torch.randn(2, 4, 6, 6, generator=generator)  # 9 target tokens
    text = family.tiny_config["joint_attention_dim"]
    batch = {
        "prompt_embeds": torch.randn(2, 5, text, generator=generator),
        "pooled": torch.randn(2, 32, generator=generator),  # Kontext's (Flux.2 takes none)
        "reference_latents": torch.randn(2, 4, 4, 6, generator=generator),  # 6 more tokens
    }
    sigmas = torch.tensor([0.3, 0.8])
    upstream = torch.randn(2, 4, 6, 6, generator=generator)

    reference = build()
    expected = family().predict(reference, noisy, sigmas, batch)
    (expected * upstream).sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        config = {"runtime": {"device": "cpu"}, "results_dir": tmp, "global_batch_size": 2,
                  "max_steps": 1, "optimization": {"parallel": {"strategy": "ddp", "sp_size": sp}}}  # fmt: skip
        gen = litegen.initialize(MainConfig.from_dict(config))
        model = gen.prepare(build())
        tokens = []  # the image tokens each rank embeds
        gen.unwrap(model).x_embedder.register_forward_hook(
            lambda _, args, __: tokens.append(args[0].shape[1])
        )
        got = family().predict(model, noisy, sigmas, batch)
        (got * upstream).sum().backward()
    grads = {n: p.grad for n, p in gen.unwrap(model).named_parameters()}
    return {
        "tokens": tokens,
        "prediction": (got.detach(), expected.detach()),
        "grads": {n: (grads[n], p.grad) for n, p in reference.named_parameters()},
    }


def both(sp: int) -> dict:
    return {name: one_step(name, sp) for name in FAMILIES}


def test_sp2_prediction_and_gradients_equal_one_process():
    # Each rank's share of 9 target and 6 reference tokens, padded to 16.
    shares = {"flux2": [8], "flux_kontext": [8]}
    for rank in run_ranks(both, 2, 2):
        for name, result in rank.items():
            assert result["tokens"] == shares[name], name
            torch.testing.assert_close(*result["prediction"], rtol=1e-5, atol=1e-5, msg=name)
            scale = max(ref.abs().max().item() for _, ref in result["grads"].values())
            for param, (grad, ref) in result["grads"].items():
                torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5 * scale, msg=param)
