"""The Qwen-Image-Edit family checked against QwenImageEditPipeline's own code: the text is the
pipeline's prompt encoding read with the reference image (and differs from the caption alone),
the empty caption is cached per sample with its reference and caption dropout swaps it in, the
reference latents are the pipeline's, and the tiny pipeline folder loads in diffusers with its
processor left out, the family's image processor taking the folder's settings. The Plus
pipeline's variant reads each sample's caption with its own reference, as its pipeline reads
one prompt with one image."""

from __future__ import annotations

import pytest
import torch

from litegen.families import family_for_pipeline, family_for_transformer
from litegen.families.base import empty_caption_key
from litegen.families.qwen_image import QwenImage
from litegen.families.qwen_image_edit import (
    REFERENCE,
    QwenImageEdit,
    image_processor_for,
    reference_images,
    with_processor,
)
from litegen.families.qwen_image_edit_plus import QwenImageEditPlus
from tests.pipelines import tiny_pipeline_folder

diffusers = pytest.importorskip("diffusers")
CAPTIONS = ["a red fox in the snow", "a cat"]


@pytest.fixture(scope="module")
def pipe():
    from diffusers import QwenImageEditPipeline

    folder = tiny_pipeline_folder("qwen_image_edit")
    return QwenImageEditPipeline.from_pretrained(folder, processor=None)


@pytest.fixture(scope="module")
def pixels():
    return torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_edit_is_a_variant_of_qwen_image_found_by_its_pipeline():
    assert family_for_pipeline("QwenImageEditPipeline") is QwenImageEdit
    # The shared transformer class answers Qwen-Image: one key map for both.
    assert family_for_transformer("QwenImageTransformer2DModel") is QwenImage
    assert QwenImageEdit.original_keys is QwenImage.original_keys
    assert QwenImageEdit.media_conditions["reference"].required


def test_the_text_is_the_pipelines_read_with_the_reference(pipe, pixels):
    family = QwenImageEdit(pipe.scheduler.config)
    with torch.no_grad():
        ours = family.encode_text_with(pipe, CAPTIONS, {"reference": pixels})
        images = reference_images(pipe, pixels)
        with with_processor(pipe):
            theirs, mask = pipe.encode_prompt(CAPTIONS, image=images, device="cpu")
            empty, _ = pipe.encode_prompt(["", ""], image=images, device="cpu")
        alone = family.encode_text_with(pipe, CAPTIONS, {"reference": -pixels})
    lengths = mask.sum(dim=1)
    for row, length in enumerate(lengths.tolist()):
        assert ours["prompt_embeds_mask"][row].sum() == length
        torch.testing.assert_close(ours["prompt_embeds"][row, :length], theirs[row, :length])
        assert ours["prompt_embeds"][row, length:].abs().sum() == 0  # padding
    # Room for a caption of the tokenizer's length beyond the image's tokens.
    assert ours["prompt_embeds"].shape[1] == empty.shape[1] + pipe.tokenizer.model_max_length
    dropped = ours[empty_caption_key("prompt_embeds")]
    torch.testing.assert_close(dropped[:, : empty.shape[1]], empty)
    # Another image, another text: the text encoder reads the reference.
    assert not torch.allclose(alone["prompt_embeds"], ours["prompt_embeds"])


def test_plus_reads_each_caption_with_its_own_reference(pixels):
    from diffusers import QwenImageEditPlusPipeline

    assert family_for_pipeline("QwenImageEditPlusPipeline") is QwenImageEditPlus
    plus = QwenImageEditPlusPipeline.from_pretrained(
        tiny_pipeline_folder("qwen_image_edit_plus"), processor=None
    )
    family = QwenImageEditPlus(plus.scheduler.config)
    with torch.no_grad():
        ours = family.encode_text_with(plus, CAPTIONS, {"reference": pixels})
        images = reference_images(plus, pixels)
        with with_processor(plus):
            theirs = [
                plus.encode_prompt([caption], image=[image], device="cpu")[0]
                for caption, image in zip(CAPTIONS, images, strict=True)
            ]
            empty = plus.encode_prompt([""], image=[images[1]], device="cpu")[0]
    for row, embeds in enumerate(theirs):
        length = embeds.shape[1]
        assert ours["prompt_embeds_mask"][row].sum() == length
        torch.testing.assert_close(ours["prompt_embeds"][row, :length], embeds[0])
    dropped = ours[empty_caption_key("prompt_embeds")][1]
    torch.testing.assert_close(dropped[: empty.shape[1]], empty[0])


def test_caption_dropout_swaps_in_each_samples_own_empty_caption(pipe, pixels):
    from litegen.finetune.training import CaptionDropout

    family = QwenImageEdit(pipe.scheduler.config)
    with torch.no_grad():
        batch = family.encode_text_with(pipe, CAPTIONS, {"reference": pixels})
        cached_empty = family.encode_text(pipe, [""])  # the cache's one empty caption
    one_empty = {name: value[0] for name, value in cached_empty.items()}
    dropped = CaptionDropout(1.0, one_empty)(batch)
    for name in ("prompt_embeds", "prompt_embeds_mask"):
        torch.testing.assert_close(dropped[name], batch[empty_caption_key(name)])
    kept = CaptionDropout(0.0, one_empty)(batch)
    torch.testing.assert_close(kept["prompt_embeds"], batch["prompt_embeds"])


def test_the_reference_latents_are_the_pipelines(pipe, pixels):
    family = QwenImageEdit(pipe.scheduler.config)
    with torch.no_grad():
        ours = family.encode_condition(pipe, "reference", pixels, pixels, micro_batch_size=1)
        theirs = pipe._encode_vae_image(pixels.unsqueeze(2), generator=None)
    assert ours.keys() == {REFERENCE}
    torch.testing.assert_close(ours[REFERENCE], theirs.squeeze(2))


def test_the_image_processor_takes_the_folders_settings(tmp_path, pipe):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    QwenImageEdit().encode_text(pipe, ["a fox"])  # gives the pipeline a processor for the call
    assert pipe.processor is None
    pipe.save_pretrained(tmp_path)
    assert not (tmp_path / "processor").exists()  # the tiny pipeline has none
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 16).save_pretrained(
        tmp_path / "processor"
    )
    loaded = diffusers.QwenImageEditPipeline.from_pretrained(tmp_path, processor=None)
    processor = image_processor_for(loaded)
    assert processor.image_processor.size == {
        "shortest_edge": 28 * 28 * 8,
        "longest_edge": 28 * 28 * 16,
    }
    assert processor.tokenizer is loaded.tokenizer
    assert image_processor_for(pipe).image_processor.size == Qwen2VLImageProcessorPil().size
