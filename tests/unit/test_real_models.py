"""litegen_zoo/real_models.py: the configs build, and a tiny batch reaches every parameter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from litegen_zoo.real_models import REAL_MODELS


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_the_published_config_builds_with_its_values(name):
    spec = REAL_MODELS[name]
    with torch.device("meta"):  # billions of parameters, no memory
        model = spec.build("reference")
    for key, value in spec.reference.items():
        stored = model.config[key]
        assert (list(stored) if isinstance(stored, tuple | list) else stored) == (
            list(value) if isinstance(value, tuple) else value
        ), key


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_a_tiny_batch_trains_every_parameter(name):
    """The batch holds every input the forward needs: each parameter is in the graph.

    (Some gradients are zero by design: SD3's last block drops its text tokens' outputs, so its
    text queries learn nothing.)
    """
    spec = REAL_MODELS[name]
    model = spec.build("tiny")
    batch = spec.batch("tiny", batch_size=2, seed=0)
    assert spec.predict(model, batch).shape == batch["latents"].shape
    spec.loss(model, batch).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_batches_are_seeded_and_split_into_samples():
    spec = REAL_MODELS["hunyuan_video"]
    first, again = spec.batch(seed=3), spec.batch(seed=3)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["latents"], spec.batch(seed=4)["latents"])
    assert {v.shape[0] for v in spec.batch(batch_size=5).values()} == {5}


@pytest.mark.parametrize(
    ("recipe", "size", "name"), [("dit_imagenet", "xl", "dit"), ("wan_video", "1.3b", "wan")]
)
def test_recipes_train_the_zoos_published_configs(recipe, size, name):
    """Recipes are standalone files a user copies, so they spell the published config out
    instead of importing the zoo; this keeps the two copies equal."""
    path = Path(__file__).resolve().parents[2] / "recipes" / f"{recipe}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.MODELS[size] == REAL_MODELS[name].reference
