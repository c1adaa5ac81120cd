"""vae_encode: slicing agrees with whole-batch encoding and bounds the per-call batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litegen.utils.encode import vae_encode

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def image_vae() -> nn.Module:
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=16,
        scaling_factor=0.5,
        shift_factor=0.25,
    )
    return vae.eval()


@pytest.fixture(scope="module")
def video_vae() -> nn.Module:
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[True],
    )
    return vae.eval()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-6) -> None:
    # Not torch.testing.assert_close: it imports torch.distributed.tensor (seconds) on first use.
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = (actual - expected).abs().max().item()
    assert diff <= tol * (1 + expected.abs().max().item()), diff


def record_batch_sizes(vae: nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    original = vae.encode

    def encode(x: torch.Tensor, *args, **kwargs):
        sizes.append(x.shape[0])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(vae, "encode", encode)
    return sizes


def test_mode_sliced_equals_whole_and_diffusers(image_vae, monkeypatch):
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        expected = (image_vae.encode(x).latent_dist.mode() - 0.25) * 0.5
    sizes = record_batch_sizes(image_vae, monkeypatch)
    sliced = vae_encode(image_vae, x, micro_batch_size=2, sample=False)
    assert sizes == [2, 2, 1]
    whole = vae_encode(image_vae, x, micro_batch_size=5, sample=False)
    assert sliced.shape == (5, 4, 8, 8)
    # CPU convolutions pick kernels by batch size, so the network itself differs in the
    # last bits; test_slicing_adds_no_error_of_its_own checks bit equality.
    assert_close(sliced, whole, tol=1e-6)
    assert_close(sliced, expected, tol=1e-6)
    assert not sliced.requires_grad


class ElementwiseVAE(nn.Module):
    """Batch-invariant stand-in: each latent depends only on its own pixels."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.5))

    def encode(self, x: torch.Tensor):
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        params = torch.cat([x * self.weight, x.tanh()], dim=1)
        return type("Out", (), {"latent_dist": DiagonalGaussianDistribution(params)})()


def test_slicing_adds_no_error_of_its_own():
    vae = ElementwiseVAE()
    x = torch.randn(6, 2, 4, 4)

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(i) for i in range(6)]

    for sample in (False, True):
        whole = vae_encode(vae, x, micro_batch_size=6, sample=sample, generator=gens())
        for micro in (1, 4):
            sliced = vae_encode(vae, x, micro_batch_size=micro, sample=sample, generator=gens())
            assert_close(sliced, whole, tol=0)
    with torch.no_grad():
        expected = vae.encode(x).latent_dist.sample(gens())
    assert_close(whole, expected, tol=0)


def test_per_sample_generators_match_diffusers_whole_batch(image_vae):
    x = torch.randn(4, 3, 16, 16)

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(4)]

    with torch.no_grad():
        expected = image_vae.encode(x).latent_dist.sample(gens())
    sliced = vae_encode(image_vae, x, micro_batch_size=1, generator=gens(), scale=False)
    assert_close(sliced, expected, tol=1e-6)
    # Sample i depends only on generator i: reordering the batch reorders the latents.
    first_two = vae_encode(image_vae, x[:2], micro_batch_size=2, generator=gens()[:2], scale=False)
    assert_close(first_two, sliced[:2], tol=1e-6)
    # Sampling adds noise: it differs from the mode.
    mode = vae_encode(image_vae, x, micro_batch_size=4, sample=False, scale=False)
    assert not torch.allclose(sliced, mode)


def test_single_generator_slicing_does_not_change_samples(image_vae):
    x = torch.randn(3, 3, 16, 16)
    a = vae_encode(image_vae, x, micro_batch_size=1, generator=torch.Generator().manual_seed(7))
    b = vae_encode(image_vae, x, micro_batch_size=3, generator=torch.Generator().manual_seed(7))
    assert_close(a, b, tol=1e-6)


def test_video_folded_through_image_vae(image_vae, monkeypatch):
    x = torch.randn(2, 3, 3, 16, 16)  # (B, C, T, H, W)
    sizes = record_batch_sizes(image_vae, monkeypatch)
    z = vae_encode(image_vae, x, micro_batch_size=4, sample=False, scale=False)
    assert sizes == [4, 2]  # 6 frames folded into the batch, at most 4 per call
    assert z.shape == (2, 4, 3, 8, 8)
    frame = vae_encode(image_vae, x[1, :, 2][None], micro_batch_size=1, sample=False, scale=False)
    assert_close(z[1, :, 2], frame[0], tol=1e-5)

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(i) for i in range(2)]  # one per clip

    a = vae_encode(image_vae, x, micro_batch_size=1, generator=gens(), frames="fold")
    b = vae_encode(image_vae, x, micro_batch_size=6, generator=gens(), frames="fold")
    assert_close(a, b, tol=1e-5)
    assert not torch.allclose(a, vae_encode(image_vae, x, micro_batch_size=6, sample=False))


def test_video_vae_gets_whole_clips(video_vae, monkeypatch):
    x = torch.randn(3, 3, 5, 16, 16)
    with torch.no_grad():
        expected = video_vae.encode(x).latent_dist.mode()
    sizes = record_batch_sizes(video_vae, monkeypatch)
    z = vae_encode(video_vae, x, micro_batch_size=2, sample=False)
    assert sizes == [2, 1]
    assert z.shape == (3, 4, 3, 8, 8)
    assert_close(z, expected, tol=1e-5)


def test_video_vae_per_clip_generators(video_vae):
    x = torch.randn(2, 3, 5, 16, 16)

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(i) for i in range(2)]

    with torch.no_grad():
        expected = video_vae.encode(x).latent_dist.sample(gens())
    z = vae_encode(video_vae, x, micro_batch_size=1, generator=gens())
    assert_close(z, expected, tol=1e-5)


def test_plain_callable_returning_tensor():
    calls: list[int] = []

    def encode(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x.mean(dim=1, keepdim=True) * 2

    x = torch.randn(7, 3, 4, 4)
    z = vae_encode(encode, x, micro_batch_size=3)
    assert calls == [3, 3, 1]
    assert_close(z, x.mean(dim=1, keepdim=True) * 2)
    scaled = vae_encode(encode, x, micro_batch_size=3, scaling_factor=3.0, shift_factor=1.0)
    assert_close(scaled, (z - 1.0) * 3.0)


def test_user_mistakes_raise_value_error(image_vae):
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match="micro_batch_size"):
        vae_encode(image_vae, x, micro_batch_size=0)
    with pytest.raises(ValueError, match="one per sample"):
        vae_encode(image_vae, x, micro_batch_size=1, generator=[torch.Generator()])
    with pytest.raises(ValueError, match="unsqueeze"):
        vae_encode(image_vae, x[0], micro_batch_size=1)
    with pytest.raises(ValueError, match="frames="):
        vae_encode(lambda t: t, torch.randn(1, 3, 2, 4, 4), micro_batch_size=1)
