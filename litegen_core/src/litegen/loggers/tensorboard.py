"""TensorBoard event files under ``<results_dir>/tensorboard`` (``trainer.loggers: [tensorboard]``).

Scalars go under ``train/<name>`` (the validation loss under ``val/loss``:
:func:`scalar_tag`); sample files under ``samples/<file name>``, sent as the encoded PNG
or GIF itself (TensorBoard's image tab plays GIFs); an MP4 sample goes as a GIF of its
frames, since the image tab does not play MP4.
"""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

from litegen.loggers.conventions import GIF_FRAME_MS, scalar_tag


def gif_bytes(path: Path) -> bytes:
    """An MP4 sample re-encoded as an animated GIF in memory, for TensorBoard's image tab (which
    plays GIFs, not MP4s).

    Example::

        gif_bytes(Path("results/wan/samples/step_100/samples.mp4"))[:6]
    """
    import av

    with av.open(str(path)) as container:
        frames = [frame.to_image() for frame in container.decode(video=0)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:],
                   duration=GIF_FRAME_MS, loop=0)  # fmt: skip
    return buffer.getvalue()


class TensorBoardSink:
    """Example:
    >>> sink = TensorBoardSink(Path("results/dit/tensorboard")); sink.scalars(1, {"loss": 0.5})
    """

    def __init__(self, folder: Path) -> None:
        self.writer = SummaryWriter(str(folder))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(scalar_tag(key), value, step)

    def media(self, step: int, files: list[Path]) -> None:
        for path in files:
            encoded = gif_bytes(path) if path.suffix.lower() == ".mp4" else path.read_bytes()
            with Image.open(io.BytesIO(encoded)) as picture:
                width, height = picture.size
                channels = len(picture.getbands())
            image = Summary.Image(
                height=height,
                width=width,
                colorspace=channels,
                encoded_image_string=encoded,
            )
            summary = Summary(value=[Summary.Value(tag=f"samples/{path.stem}", image=image)])
            self.writer.file_writer.add_summary(summary, step)

    def close(self) -> None:
        self.writer.close()


__all__ = ["TensorBoardSink"]
