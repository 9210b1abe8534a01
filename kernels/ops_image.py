"""ImageDecoder (opset 20): an encoded image (a 1-D uint8 tensor of the file's bytes) to uint8 pixels, HWC.

A host op: the bytes are read back (``host_inputs``, which makes the node a host seam of any capture
plan: ``capture="unsupported"``) and decoded with Pillow in ``shapes()`` (the output's shape is the
image's), then the pixels are uploaded. ``pixel_format`` ``RGB`` (default) and ``BGR`` give
``(H, W, 3)`` (the image converted to RGB first, whatever its mode, then the channels reversed for
BGR); ``Grayscale`` gives ``(H, W, 1)`` (Pillow's ``L`` conversion, as ONNX's reference). Formats
are Pillow's (JPEG, PNG, BMP, TIFF, WebP, PNM, JPEG 2000, ...).

Pillow is an optional dependency (the ``image`` extra, also in ``test``): without it a model with
this op is refused at load as ``Unsupported``. Bytes Pillow cannot decode (corrupt or truncated data,
an unknown format, an image past Pillow's decompression-bomb limit) are an ``OpError`` naming the
node, never a crash.
"""

from __future__ import annotations

import io

import numpy as np

from ._op import OpKernel, Spec

__all__ = ["OPS"]

_FORMATS = ("RGB", "BGR", "Grayscale")


def _pil():
    try:
        import PIL.Image
    except ImportError:
        return None
    return PIL.Image


def _check(node):
    fmt = node.attr("pixel_format", "RGB")
    if fmt not in _FORMATS:
        raise node.error(f"attribute pixel_format={fmt!r} is invalid: allowed: 'RGB', 'BGR', 'Grayscale'")
    if _pil() is None:
        from lockstep.engines.protocol import Unsupported  # the protocol's exception: kernels do not import the runtime

        raise Unsupported(f"ImageDecoder: {node.name}: decoding needs Pillow (pip install 'lockstep-conformance[image]')")


def decode(node, data: np.ndarray, fmt: str) -> np.ndarray:
    """The pixels of the encoded image ``data`` (1-D uint8) as uint8 HWC in ``fmt``; OpError if undecodable."""
    Image = _pil()
    try:
        with Image.open(io.BytesIO(data.tobytes())) as img:
            img.load()
            if fmt == "Grayscale":
                return np.asarray(img.convert("L"), dtype=np.uint8)[:, :, None]
            rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except Exception as exc:  # Pillow raises many kinds (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise node.error(f"cannot decode the encoded_stream ({data.size} bytes) as an image: "
                         f"{type(exc).__name__}: {exc}") from exc
    return np.ascontiguousarray(rgb[:, :, ::-1]) if fmt == "BGR" else rgb


def _shapes(node, specs):
    s = specs[0]
    if s.dtype != np.uint8 or s.rank != 1:
        raise node.error(f"encoded_stream must be a 1-D uint8 tensor, got {s.dtype} of shape {s.shape}")
    if s.value is None:
        raise node.error("encoded_stream must be known on the host")
    pixels = decode(node, np.asarray(s.value), node.attr("pixel_format", "RGB"))
    return [Spec(tuple(pixels.shape), np.dtype(np.uint8), pixels)]


def _compute(xp, node, _encoded):
    return (xp.asarray(node.out_specs[0].value),)


OPS = [OpKernel("ImageDecoder", _shapes, _compute, since=20, host_inputs=(0,), check=_check,
                capture="unsupported", reason="decodes the image on the host (Pillow) and uploads the pixels")]
