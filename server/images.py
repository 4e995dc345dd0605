"""The images clients send, decoded and checked before any model sees them.

Why: an image is the largest and least trusted thing a request carries. A few kilobytes
of PNG can claim a 100000x100000 canvas; a truncated file can crash a preprocessor deep
in a batch. So every image is checked here, at the edge, once: its encoded size, its
real format against the declared one, its dimensions from the header before a pixel is
decoded, and then a full decode. Each refusal is a 400 naming the JSON path, what was
wrong and the flag that sets the limit.

The checks decode, so they cost CPU: the async entry points run them in a worker
thread; a caller of the sync ones with large images should too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from PIL import Image, UnidentifiedImageError

from server.errors import ApiError, bad_request
from server.image_urls import fetch_image_bytes, parse_url_hosts

MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
"""Pillow's format name -> the media type clients declare; nothing else is accepted."""
_FORMATS = tuple(MEDIA_TYPES)
_DETECTED = {**MEDIA_TYPES, "MPO": "image/jpeg"}  # a camera's multi-picture JPEG is a JPEG
_ALIASES = {"image/jpg": "image/jpeg"}
_KINDS = "PNG, JPEG, GIF or WebP"
_EXIF_ORIENTATION = 0x0112
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
"""EXIF orientation -> the transpose that shows the photo the way the camera held it."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be; the CLI flags' defaults live here."""

    max_bytes: int = 20 * 1024 * 1024
    """Encoded size of one image (--max-image-bytes)."""
    max_pixels: int = 40_000_000
    """width * height of one image, read from the header before decoding (--max-image-pixels)."""
    min_side: int = 2
    """Narrower or shorter than this is refused: a 1x1 image is a tracking pixel, not input."""
    max_images: int = 16
    """Images in one request (--max-images-per-request)."""
    url_hosts: tuple[str, ...] = ()
    """Hosts, IPs and CIDR networks image URLs may name (--allow-image-urls); empty: no URLs."""
    url_timeout_s: float = 10.0
    """Seconds one URL fetch may take, from resolving to the last byte (--image-url-timeout)."""

    @classmethod
    def from_args(cls, args: Any) -> ImageLimits:
        """From `tandem serve`'s namespace; a namespace without the flags gets the defaults."""
        hosts = getattr(args, "allow_image_urls", None) or ()
        if isinstance(hosts, str):
            hosts = parse_url_hosts(hosts)
        return cls(
            max_bytes=getattr(args, "max_image_bytes", cls.max_bytes),
            max_pixels=getattr(args, "max_image_pixels", cls.max_pixels),
            max_images=getattr(args, "max_images_per_request", cls.max_images),
            url_hosts=tuple(hosts),
            url_timeout_s=getattr(args, "image_url_timeout", cls.url_timeout_s),
        )


@dataclass(frozen=True)
class ImageInput:
    """One checked image: the bytes as sent, what they are, and their upright size.

    Holds bytes, not pixels: cheap to keep with a request, to hash, to log the size of.
    `width` and `height` are as `pil()` returns the image (EXIF rotation applied).
    """

    data: bytes
    media_type: str
    digest: str
    width: int
    height: int

    def pil(self) -> Image.Image:
        """Decoded anew, upright, in RGB: the first frame of an animation, transparency
        over white (as a viewer shows it; dropping alpha would leave black shapes)."""
        with Image.open(io.BytesIO(self.data), formats=_FORMATS) as img:
            img.load()
            return _rgb(_upright(img))


def image_from_data_url(url: str, limits: ImageLimits, param: str) -> ImageInput:
    """An OpenAI chat `image_url` or Responses `input_image`: `data:image/png;base64,...`."""
    header, comma, payload = url.partition(",")
    if not comma or header[:5].lower() != "data:":
        raise bad_request(
            f"{param} is not a data URL; send data:<media type>;base64,<data> or an http(s) URL",
            param,
        )
    media_type, *options = header[5:].split(";")
    if "base64" not in (option.strip().lower() for option in options):
        raise bad_request(
            f"{param} is a data URL without ';base64': images must be base64-encoded "
            "(data:image/png;base64,...)",
            param,
        )
    return image_from_base64(payload, media_type or "text/plain", limits, param)


def image_from_base64(data: str, media_type: str, limits: ImageLimits, param: str) -> ImageInput:
    """An Anthropic `{"type": "base64", "media_type", "data"}` source."""
    declared = _media_type(media_type, param)
    return image_from_bytes(_decode_base64(data, limits, param), declared, limits, param)


async def image_from_url(url: str, limits: ImageLimits, param: str) -> ImageInput:
    """An http(s) URL, fetched only as --allow-image-urls permits (server.image_urls).
    The bytes decide the format; the response's Content-Type need only say image/*."""
    data = await fetch_image_bytes(url, limits, param)
    return await anyio.to_thread.run_sync(image_from_bytes, data, None, limits, param)


async def image_from_reference(url: str, limits: ImageLimits, param: str) -> ImageInput:
    """A URL field that may hold either a data URL or an http(s) URL."""
    scheme = url.lstrip()[:8].lower()
    if scheme.startswith("data:"):
        return await anyio.to_thread.run_sync(image_from_data_url, url, limits, param)
    if scheme.startswith(("http://", "https://")):
        return await image_from_url(url, limits, param)
    raise bad_request(f"{param} must be a data: URL (base64 image) or an http(s) URL", param)


def check_image_count(count: int, limits: ImageLimits, param: str) -> None:
    if count > limits.max_images:
        raise bad_request(
            f"{param} holds {count} images, over the limit of {limits.max_images} per request "
            "(--max-images-per-request)",
            param,
        )


def image_from_bytes(
    data: bytes, declared: str | None, limits: ImageLimits, param: str
) -> ImageInput:
    """Every check on the encoded bytes; `declared` (a media type), if given, must match
    the format the bytes really are, as Anthropic requires."""
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(f"{len(data)} bytes", limits, param)
    img = _open(data, limits, param)
    with img:
        media_type = _DETECTED[str(img.format)]
        if declared is not None and declared != media_type:
            raise bad_request(
                f"{param} is declared {declared} but its bytes are {media_type}; "
                "send the media type the image really has",
                param,
            )
        _check_size(img.size, limits, param)
        _check_decodes(img, param)
        width, height = img.size
        if _orientation(img) >= 5:  # the rotations by 90 degrees
            width, height = height, width
    return ImageInput(data, media_type, hashlib.sha256(data).hexdigest(), width, height)


def _media_type(media_type: str, param: str) -> str:
    normal = media_type.split(";")[0].strip().lower()
    normal = _ALIASES.get(normal, normal)
    if normal not in MEDIA_TYPES.values():
        raise bad_request(
            f"{param} has media type {media_type.strip()!r}; images must be one of "
            f"{', '.join(MEDIA_TYPES.values())}",
            param,
        )
    return normal


def _decode_base64(data: str, limits: ImageLimits, param: str) -> bytes:
    """Refuses by length before decoding: a huge string costs nothing to turn away."""
    if len(data) > 3 * limits.max_bytes:  # base64 is 4/3 of its bytes, plus line breaks
        raise _too_many_bytes(f"about {len(data) * 3 // 4} bytes", limits, param)
    compact = "".join(data.split())
    size = len(compact) * 3 // 4 - compact[-2:].count("=")
    if size > limits.max_bytes:
        raise _too_many_bytes(f"{size} bytes", limits, param)
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param} is not valid base64 image data", param) from None


def _open(data: bytes, limits: ImageLimits, param: str) -> Image.Image:
    """Reads the header only: format and size, not the pixels."""
    try:
        return Image.open(io.BytesIO(data), formats=_FORMATS)
    except UnidentifiedImageError:
        raise bad_request(f"{param} is not a {_KINDS} image", param) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise bad_request(
            f"{param} claims more than {Image.MAX_IMAGE_PIXELS} pixels in its header, over "
            f"the {limits.max_pixels}-pixel limit (--max-image-pixels)",
            param,
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise _undecodable(param, exc) from None


def _check_size(size: tuple[int, int], limits: ImageLimits, param: str) -> None:
    width, height = size
    if width * height > limits.max_pixels:
        raise bad_request(
            f"{param} is {width * height} pixels ({width}x{height}), over the "
            f"{limits.max_pixels}-pixel limit (--max-image-pixels)",
            param,
        )
    if min(width, height) < limits.min_side:
        raise bad_request(
            f"{param} is {width}x{height}; images must be at least "
            f"{limits.min_side}x{limits.min_side} pixels",
            param,
        )


def _check_decodes(img: Image.Image, param: str) -> None:
    """Decodes every pixel (of the first frame), so a truncated or corrupt file is refused
    here rather than failing inside a batch."""
    try:
        img.load()
    except Exception as exc:  # Pillow's decoders raise OSError, SyntaxError, struct.error...
        raise _undecodable(param, exc) from None


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(_EXIF_ORIENTATION, 1))
    except Exception:  # a malformed EXIF block leaves the image as stored
        return 1


def _upright(img: Image.Image) -> Image.Image:
    transpose = _UPRIGHT.get(_orientation(img))
    return img.transpose(transpose) if transpose is not None else img


def _rgb(img: Image.Image) -> Image.Image:
    if "A" not in img.mode and "transparency" not in img.info:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    flat = Image.new("RGB", rgba.size, (255, 255, 255))
    flat.paste(rgba, mask=rgba.getchannel("A"))
    return flat


def _too_many_bytes(size: str, limits: ImageLimits, param: str) -> ApiError:
    return bad_request(
        f"{param} is {size}, over the {limits.max_bytes}-byte limit of one image "
        "(--max-image-bytes)",
        param,
    )


def _undecodable(param: str, exc: BaseException) -> ApiError:
    return bad_request(
        f"{param} could not be decoded (truncated or corrupt {_KINDS} file: {exc})", param
    )
