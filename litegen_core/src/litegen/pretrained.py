"""Pretrained diffusers pipelines from a local folder: one component trained, the rest frozen.

A pipeline folder is what ``save_pretrained`` writes (and what the hub serves): a
``model_index.json`` naming each component's library and class, and one subfolder per component
(``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``, ...).
:func:`check_pipeline_folder` checks that layout, and each model component's weights files as
far as their headers tell, without importing torch, so a launcher can refuse a bad folder
before the ranks start; :func:`load_component` loads one component (a
training process needs the transformer alone when latents and text embeddings are cached);
:func:`load_pipeline` loads the whole pipeline with every component but the trained ones frozen
(``requires_grad`` off, eval mode). Nothing is downloaded: loading is ``local_files_only``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MODEL_INDEX = "model_index.json"
COMPONENT_LIBRARIES = ("diffusers", "transformers")
_MAX_HEADER = 100_000_000  # safetensors' own bound on a header


def check_pipeline_folder(folder: str | Path) -> dict[str, tuple[str, str]]:
    """The components of the pipeline folder ``folder`` as ``{name: (library, class)}``.

    Raises ``ValueError`` naming the path and the fix when the folder, its
    ``model_index.json``, a component's subfolder or a model component's weights file is
    missing, or a weights file's header is damaged (:func:`weights_problem`).

    Example::

        check_pipeline_folder("Wan2.1-T2V-1.3B-Diffusers")
    """
    folder = Path(folder)
    index = folder / MODEL_INDEX
    if not index.is_file():
        what = "does not exist" if not folder.exists() else f"has no {MODEL_INDEX}"
        raise ValueError(
            f"pipeline folder {folder} {what}: point finetune.pipeline at a diffusers pipeline "
            "folder (the one save_pretrained writes, with model_index.json and a subfolder per "
            "component)."
        )
    try:
        entries = json.loads(index.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{index} is not valid JSON ({error}); re-save the pipeline.") from None
    components = {
        name: (value[0], value[1])
        for name, value in entries.items()
        if not name.startswith("_")
        and isinstance(value, list)
        and len(value) == 2
        and value[0] is not None
    }
    for name in components:
        sub = folder / name
        if not sub.is_dir() or not any(sub.iterdir()):
            raise ValueError(
                f"pipeline folder {folder} misses its {name!r} component ({sub} is "
                f"{'empty' if sub.is_dir() else 'missing'}): copy that subfolder from the "
                "published pipeline, or re-save the whole pipeline with save_pretrained."
            )
        problem = weights_problem(sub)
        if problem:
            raise ValueError(
                f"pipeline folder {folder}: the {name!r} component {problem}. Copy that "
                "subfolder again from the published pipeline, or re-save the whole pipeline "
                "with save_pretrained."
            )
    return components


def weights_problem(component: Path) -> str | None:
    """What is wrong with the weights of one component folder, or None.

    A folder with a ``config.json`` is a model (the tokenizer and scheduler have none) and needs
    weights: ``*.safetensors`` files, whose headers must parse and fit the file (the tensor data
    is not read), or the shards a ``*.safetensors.index.json`` lists, or ``.bin`` files.

    Example:
        >>> Path("vae").mkdir()
        >>> _ = Path("vae/config.json").write_text("{}")
        >>> weights_problem(Path("vae"))
        'has no weights file in vae (diffusion_pytorch_model.safetensors, model.safetensors or their .bin)'
    """
    if not (component / "config.json").is_file():
        return None
    files = set(component.glob("*.safetensors"))
    for index in component.glob("*.safetensors.index.json"):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return f"has an unreadable shard index {index} ({type(err).__name__}: {err})"
        missing = sorted(shard for shard in shards if not (component / shard).is_file())
        if missing:
            return f"misses the weights file {component / missing[0]}, which {index.name} lists"
        files |= {component / shard for shard in shards}
    for file in sorted(files):
        problem = safetensors_header_problem(file)
        if problem:
            return f"has a damaged weights file {file} ({problem})"
    if not files and not any(p.suffix == ".bin" and p.stat().st_size for p in component.iterdir()):
        return (
            f"has no weights file in {component} (diffusion_pytorch_model.safetensors, "
            "model.safetensors or their .bin)"
        )
    return None


def safetensors_header_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file, from its header alone, or None.

    The file is an 8-byte little-endian header length, a JSON header giving each tensor's byte
    range, then the data: a truncated or overwritten file shows in the header or its ranges.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        length = int.from_bytes(head, "little")
        if not 2 <= length <= min(size - 8, _MAX_HEADER):
            return f"its header length {length} does not fit the file's {size} bytes"
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            return f"its header is not JSON: {err}"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data = size - 8 - length
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]):
            return f"its header gives no byte range for {key!r}"
        if offsets[1] > data:
            return f"{key!r} ends at byte {offsets[1]} of a data section of {data} (truncated)"
    return None


def load_component(folder: str | Path, name: str, **kwargs: Any) -> Any:
    """Load the component ``name`` of the pipeline folder with its class's ``from_pretrained``.

    ``kwargs`` go to ``from_pretrained`` (``torch_dtype=...``).

    Example::

        transformer = load_component("tiny_wan", "transformer")
    """
    components = check_pipeline_folder(folder)
    if name not in components:
        raise ValueError(
            f"pipeline folder {folder} has no component {name!r}; it has {sorted(components)}."
        )
    library, class_name = components[name]
    if library not in COMPONENT_LIBRARIES:  # model_index.json must not pick what is imported
        raise ValueError(
            f"{Path(folder) / MODEL_INDEX} gives the {name!r} component the library "
            f"{library!r}; LiteGen loads components of {' and '.join(COMPONENT_LIBRARIES)} only."
        )
    cls = getattr(importlib.import_module(library), class_name)
    return cls.from_pretrained(Path(folder) / name, local_files_only=True, **kwargs)


def load_pipeline(
    folder: str | Path,
    *,
    trained: Iterable[str] = ("transformer",),
    **kwargs: Any,
) -> Any:
    """The pipeline of ``folder``, every model component it loads frozen except ``trained``.

    ``kwargs`` go to the pipeline class's ``from_pretrained``: components already in memory are
    used as given and left untouched (``transformer=model`` samples with the weights being
    trained), ``torch_dtype=...``.

    Example::

        pipe = load_pipeline("tiny_wan")
        [p.requires_grad for p in pipe.vae.parameters()][:1]
    """
    import diffusers
    from torch import nn

    components = check_pipeline_folder(folder)
    trained = set(trained)
    unknown = trained - set(components)
    if unknown:
        raise ValueError(
            f"trained={sorted(unknown)} are not components of {folder}; "
            f"it has {sorted(components)}."
        )
    # from_pretrained puts every module in eval mode, the given ones too: put theirs back.
    modes = {name: value.training for name, value in kwargs.items() if isinstance(value, nn.Module)}
    # The class itself, not DiffusionPipeline: that one loads copies of the modules it is given.
    class_name = json.loads((Path(folder) / MODEL_INDEX).read_text(encoding="utf-8"))["_class_name"]
    pipeline_class = getattr(diffusers, class_name, diffusers.DiffusionPipeline)
    pipe = pipeline_class.from_pretrained(str(folder), local_files_only=True, **kwargs)
    for name, training in modes.items():
        kwargs[name].train(training)
    for name, component in pipe.components.items():
        if isinstance(component, nn.Module) and name not in trained and name not in kwargs:
            freeze(component)
    return pipe


def freeze(module: Any) -> Any:
    """``module`` with ``requires_grad`` off and in eval mode (dropout off)."""
    module.requires_grad_(False)
    return module.eval()
