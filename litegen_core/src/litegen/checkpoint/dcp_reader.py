"""Reading a DCP folder without running code from it.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and its load planner
unpickles non-tensor values (optimizer hyperparameters) with ``torch.load(weights_only=False)``:
a crafted file in a shared run folder would run code on the machine of whoever resumes or
exports from it. :class:`CheckedReader` reads ``.metadata`` with an unpickler that builds only
the classes DCP metadata is made of, and :class:`CheckedLoadPlanner` reads the non-tensor
values with ``weights_only=True``. Anything else is refused with a ValueError naming the file.

Example::

    dcp.load(state, storage_reader=CheckedReader(model_dir), planner=CheckedLoadPlanner())
"""

from __future__ import annotations

import inspect
import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"

# What DCP (torch 2.11 to 2.13) puts in .metadata besides the classes of its metadata module:
# shapes, dtypes and layouts of the tensors, where each chunk lies, and the checkpoint's path.
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    *(
        (module, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata's classes; any other global stops the read."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or _is_metadata_class(module, name):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"it refers to {module}.{name}, which DCP metadata never holds"
        )


def _is_metadata_class(module: str, name: str) -> bool:
    found = getattr(dcp_metadata, name, None) if module == dcp_metadata.__name__ else None
    return inspect.isclass(found) and found.__module__ == module


def read_dcp_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """The ``Metadata`` pickled in ``path`` (a DCP folder's ``.metadata``), built from DCP's
    metadata classes alone.

    Raises ValueError naming the file when it refers to anything else (a crafted file, whose
    code never runs); OSError, EOFError or ``pickle.UnpicklingError`` when it is truncated or
    not a pickle.

    Example::

        read_dcp_metadata("results/dit/ckpt/step_500/model_0/.metadata").state_dict_metadata
    """
    path = Path(path)
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle).load()
        except pickle.UnpicklingError as err:
            if "DCP metadata never holds" not in str(err):
                raise
            raise ValueError(
                f"{path} is not a DCP metadata file: {err}. It was not loaded (such a file can "
                "be made to run code); use a checkpoint written by LiteGen or torch DCP."
            ) from err
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP metadata.")
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's file reader, its ``.metadata`` read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_dcp_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, its non-tensor values read with ``torch.load(weights_only=True)``
    (numbers, strings, tuples, lists, dicts and tensors: what optimizer state holds)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        checked = io.BytesIO(value.read())
        try:  # refuses what weights_only refuses, before DCP's own torch.load unpickles it
            torch.load(checked, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{read_item.dest_index.fqn} holds more than plain values "
                f"({_refusal(err)}); it was not loaded (such a value can be made to run "
                "code). Use a checkpoint written by LiteGen or torch DCP."
            ) from err
        checked.seek(0)
        super().load_bytes(read_item, checked)


def _refusal(err: Exception) -> str:
    """The line of torch's long weights_only error that says what was refused."""
    match = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    return f"it refers to {match.group(1)}" if match else str(err).splitlines()[0]
