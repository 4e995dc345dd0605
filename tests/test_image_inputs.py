"""The images clients send: what server.images accepts, and each refusal's 400."""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from server.cli_args import add_image_flags
from server.errors import ApiError
from server.image_urls import HostRules
from server.images import (
    ImageLimits,
    check_image_count,
    image_from_base64,
    image_from_data_url,
    image_from_reference,
    image_from_url,
)

PARAM = "messages[0].content[1].image_url"
LIMITS = ImageLimits()


def encode(fmt: str, size: tuple[int, int] = (6, 4), mode: str = "RGB", **save) -> bytes:
    img = Image.new(mode, size, "red" if mode != "P" else 1)
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_claiming(width: int, height: int) -> bytes:
    """A small real PNG whose IHDR (CRC fixed up) claims another size: the header says
    huge, the pixels are not there, so only a header check can refuse it correctly."""
    png = bytearray(encode("PNG", (2, 2)))
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


def refusal(exc: pytest.ExceptionInfo[ApiError]) -> str:
    assert exc.value.status == 400
    assert exc.value.param == PARAM
    assert PARAM in exc.value.message
    return exc.value.message


@pytest.mark.parametrize(
    ("fmt", "media_type", "mode"),
    [
        ("PNG", "image/png", "RGB"),
        ("JPEG", "image/jpeg", "RGB"),
        ("GIF", "image/gif", "P"),
        ("WEBP", "image/webp", "RGB"),
    ],
)
def test_each_format_is_accepted_and_decodes_to_rgb(fmt: str, media_type: str, mode: str) -> None:
    data = encode(fmt, (6, 4), mode)
    image = image_from_data_url(data_url(data, media_type), LIMITS, PARAM)
    assert (image.media_type, image.width, image.height) == (media_type, 6, 4)
    assert image.data == data
    assert image.digest == hashlib.sha256(data).hexdigest()
    pil = image.pil()
    assert (pil.mode, pil.size) == ("RGB", (6, 4))


def test_anthropic_base64_source_is_accepted() -> None:
    data = encode("PNG")
    image = image_from_base64(base64.b64encode(data).decode(), "image/png", LIMITS, PARAM)
    assert (image.media_type, image.digest) == ("image/png", hashlib.sha256(data).hexdigest())


def test_base64_with_line_breaks_and_jpg_alias_is_accepted() -> None:
    data = encode("JPEG")
    wrapped = base64.encodebytes(data).decode()  # MIME style: a newline every 76 chars
    assert "\n" in wrapped
    assert image_from_base64(wrapped, "image/jpg", LIMITS, PARAM).media_type == "image/jpeg"


def test_exif_rotated_photo_reports_and_decodes_upright() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: rotate 90 degrees to show
    data = encode("JPEG", (8, 4), exif=exif)
    image = image_from_base64(base64.b64encode(data).decode(), "image/jpeg", LIMITS, PARAM)
    assert (image.width, image.height) == (4, 8)
    assert image.pil().size == (4, 8)


def test_transparency_is_flattened_onto_white() -> None:
    clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    buf = io.BytesIO()
    clear.save(buf, "PNG")
    image = image_from_base64(base64.b64encode(buf.getvalue()).decode(), "image/png", LIMITS, "p")
    assert image.pil().getpixel((0, 0)) == (255, 255, 255)


def test_truncated_png_is_refused_as_undecodable() -> None:
    noisy = Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48)
    buf = io.BytesIO()
    noisy.save(buf, "PNG")
    data = buf.getvalue()
    with pytest.raises(ApiError) as exc:
        image_from_data_url(data_url(data[: len(data) // 2], "image/png"), LIMITS, PARAM)
    assert "could not be decoded" in refusal(exc)


def test_one_pixel_image_is_refused() -> None:
    with pytest.raises(ApiError) as exc:
        image_from_data_url(data_url(encode("PNG", (1, 1)), "image/png"), LIMITS, PARAM)
    assert "1x1" in refusal(exc) and "at least 2x2" in exc.value.message


def test_pixel_limit_is_checked_from_the_header_before_decoding() -> None:
    with pytest.raises(ApiError) as exc:
        image_from_data_url(data_url(png_claiming(8000, 6000), "image/png"), LIMITS, PARAM)
    message = refusal(exc)
    assert "48000000 pixels (8000x6000)" in message
    assert "40000000-pixel limit (--max-image-pixels)" in message


def test_decompression_bomb_header_is_refused() -> None:
    with pytest.raises(ApiError) as exc:
        image_from_data_url(data_url(png_claiming(100000, 100000), "image/png"), LIMITS, PARAM)
    assert "--max-image-pixels" in refusal(exc)


def test_pixel_limit_follows_the_limits() -> None:
    with pytest.raises(ApiError) as exc:
        image_from_data_url(
            data_url(encode("PNG", (10, 10)), "image/png"), ImageLimits(max_pixels=99), PARAM
        )
    assert "100 pixels (10x10), over the 99-pixel limit" in refusal(exc)


def test_media_type_that_disagrees_with_the_bytes_is_refused() -> None:
    png = base64.b64encode(encode("PNG")).decode()
    with pytest.raises(ApiError) as exc:
        image_from_base64(png, "image/jpeg", LIMITS, PARAM)
    assert "declared image/jpeg but its bytes are image/png" in refusal(exc)
    with pytest.raises(ApiError) as exc:
        image_from_data_url(f"data:image/jpeg;base64,{png}", LIMITS, PARAM)
    assert "declared image/jpeg" in refusal(exc)


def test_non_image_data_url_is_refused() -> None:
    with pytest.raises(ApiError) as exc:
        image_from_data_url(data_url(b"hello world", "text/plain"), LIMITS, PARAM)
    assert "'text/plain'" in refusal(exc) and "image/png" in exc.value.message


def test_image_of_another_format_is_refused() -> None:
    with pytest.raises(ApiError) as exc:
        image_from_data_url(data_url(encode("BMP"), "image/png"), LIMITS, PARAM)
    assert "not a PNG, JPEG, GIF or WebP image" in refusal(exc)


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,not*base64!",
        "data:image/png,rawbytes",
        "image/png;base64,AAAA",
        "data:image/png;base64,QUJD\u00e9",
    ],
)
def test_malformed_data_url_is_refused(url: str) -> None:
    with pytest.raises(ApiError) as exc:
        image_from_data_url(url, LIMITS, PARAM)
    refusal(exc)


def test_oversized_base64_is_refused_before_decoding() -> None:
    limits = ImageLimits(max_bytes=1000)
    with pytest.raises(ApiError) as exc:
        image_from_base64("A" * 10_000_000, "image/png", limits, PARAM)
    assert "1000-byte limit of one image (--max-image-bytes)" in refusal(exc)


def test_image_just_over_the_byte_limit_is_refused() -> None:
    data = encode("PNG", (32, 32))
    with pytest.raises(ApiError) as exc:
        image_from_data_url(
            data_url(data, "image/png"), ImageLimits(max_bytes=len(data) - 1), PARAM
        )
    assert f"is {len(data)} bytes" in refusal(exc)
    exact = ImageLimits(max_bytes=len(data))
    assert image_from_data_url(data_url(data, "image/png"), exact, PARAM).data == data


def test_image_count_over_the_limit_is_refused() -> None:
    check_image_count(16, LIMITS, "messages")
    with pytest.raises(ApiError) as exc:
        check_image_count(17, LIMITS, PARAM)
    assert "17 images" in refusal(exc) and "--max-images-per-request" in exc.value.message


def test_limits_come_from_the_serve_flags() -> None:
    parser = argparse.ArgumentParser()
    add_image_flags(parser)
    args = parser.parse_args(
        ["--max-image-pixels", "500", "--allow-image-urls", "Example.com, *.cdn.net,10.0.0.0/8"]
    )
    limits = ImageLimits.from_args(args)
    assert limits.max_pixels == 500
    assert limits.url_hosts == ("example.com", "*.cdn.net", "10.0.0.0/8")
    assert ImageLimits.from_args(parser.parse_args([])) == ImageLimits()
    assert ImageLimits.from_args(argparse.Namespace()) == ImageLimits()
    with pytest.raises(SystemExit):
        parser.parse_args(["--allow-image-urls", "10.0.0.0/33"])


@pytest.mark.parametrize(
    ("host", "listed"),
    [
        ("img.example.com", True),
        ("a.b.example.com", True),
        ("example.com", False),
        ("evilexample.com", False),
        ("cdn.org", True),
        ("www.cdn.org", False),
        ("10.1.2.3", True),
        ("11.1.2.3", False),
        ("::1", True),
    ],
)
def test_host_list_matches_names_wildcards_addresses_and_networks(host: str, listed: bool) -> None:
    rules = HostRules.parse(("*.example.com", "cdn.org", "10.0.0.0/8", "[::1]"))
    assert rules.names_host(host) is listed


# -- URLs ------------------------------------------------------------------------------


@dataclass
class ImageServer:
    port: int
    png: bytes

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


class _Handler(BaseHTTPRequestHandler):
    """/png an image, /big a body without Content-Length past the limit, /slow silence,
    /redirect a 302, /text a non-image."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        server = self.server
        if self.path == "/slow":
            server.release.wait(5)  # type: ignore[attr-defined]
            return
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/png")
            self.end_headers()
            return
        if self.path == "/big":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 1024)
            return
        body, ctype = (
            (server.png, "image/png") if self.path == "/png" else (b"hi", "text/plain")  # type: ignore[attr-defined]
        )
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def image_server() -> Iterator[ImageServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.png = encode("PNG", (5, 3))  # type: ignore[attr-defined]
    httpd.release = threading.Event()  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield ImageServer(httpd.server_address[1], httpd.png)  # type: ignore[attr-defined]
    finally:
        httpd.release.set()  # type: ignore[attr-defined]
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


LOOPBACK = ImageLimits(url_hosts=("127.0.0.1",), url_timeout_s=5.0)


async def test_url_is_refused_unless_urls_are_allowed(image_server: ImageServer) -> None:
    with pytest.raises(ApiError) as exc:
        await image_from_reference(image_server.url("/png"), LIMITS, PARAM)
    assert "--allow-image-urls" in refusal(exc)


async def test_listed_loopback_address_is_fetched(image_server: ImageServer) -> None:
    image = await image_from_reference(image_server.url("/png"), LOOPBACK, PARAM)
    assert (image.media_type, image.width, image.height) == ("image/png", 5, 3)
    assert image.data == image_server.png


async def test_listed_network_allows_its_addresses(image_server: ImageServer) -> None:
    limits = ImageLimits(url_hosts=("127.0.0.0/8",))
    assert (await image_from_url(image_server.url("/png"), limits, PARAM)).width == 5


async def test_host_not_listed_is_refused(image_server: ImageServer) -> None:
    with pytest.raises(ApiError) as exc:
        await image_from_url(
            image_server.url("/png"), ImageLimits(url_hosts=("example.com",)), PARAM
        )
    assert "127.0.0.1" in refusal(exc) and "--allow-image-urls" in exc.value.message


async def test_listed_name_resolving_to_loopback_is_refused(image_server: ImageServer) -> None:
    limits = ImageLimits(url_hosts=("localhost",))
    with pytest.raises(ApiError) as exc:
        await image_from_url(image_server.url("/png", host="localhost"), limits, PARAM)
    assert "loopback address" in refusal(exc) and "--allow-image-urls" in exc.value.message


async def test_body_over_the_byte_limit_is_refused(image_server: ImageServer) -> None:
    limits = ImageLimits(url_hosts=("127.0.0.1",), max_bytes=10_000)
    with pytest.raises(ApiError) as exc:
        await image_from_url(image_server.url("/big"), limits, PARAM)
    assert "more than 10000 bytes" in refusal(exc) and "--max-image-bytes" in exc.value.message


async def test_slow_server_is_refused_at_the_timeout(image_server: ImageServer) -> None:
    limits = ImageLimits(url_hosts=("127.0.0.1",), url_timeout_s=0.5)
    with pytest.raises(ApiError) as exc:
        await image_from_url(image_server.url("/slow"), limits, PARAM)
    assert "0.5 s (--image-url-timeout)" in refusal(exc)


async def test_redirect_is_not_followed(image_server: ImageServer) -> None:
    with pytest.raises(ApiError) as exc:
        await image_from_url(image_server.url("/redirect"), LOOPBACK, PARAM)
    assert "redirect" in refusal(exc) and "not followed" in exc.value.message


async def test_non_image_content_type_is_refused(image_server: ImageServer) -> None:
    with pytest.raises(ApiError) as exc:
        await image_from_url(image_server.url("/text"), LOOPBACK, PARAM)
    assert "'text/plain'" in refusal(exc)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x.png", "file:///etc/passwd", "http:///x"])
async def test_other_schemes_and_hostless_urls_are_refused(url: str) -> None:
    with pytest.raises(ApiError) as exc:
        await image_from_reference(url, LOOPBACK, PARAM)
    refusal(exc)


async def test_reference_dispatches_data_urls() -> None:
    data = encode("WEBP")
    image = await image_from_reference(data_url(data, "image/webp"), LIMITS, PARAM)
    assert image.media_type == "image/webp"


def test_a_stored_conversation_keeps_its_newest_images_within_the_limit() -> None:
    """`PromptImages.adopt`: earlier turns' images come back before this request's
    own, the newest that fit --max-images-per-request; older ones read as the
    placeholder, in their places, and stay so in what is stored next."""
    from server.image_prompts import EARLIER_IMAGE, SENTINEL, PromptImages

    limits = ImageLimits(max_images=2)
    first, second, third, own = (
        image_from_data_url(
            f"data:image/png;base64,{base64.b64encode(encode('PNG', (4 + i, 4))).decode()}",
            limits,
            "image",
        )
        for i in range(4)
    )
    images = PromptImages(vision=object(), limits=limits)  # a model that reads images
    mine = images.add(own, "input")
    a, b = SENTINEL.format("a" * 16), SENTINEL.format("b" * 16)  # two earlier requests'
    images.adopt(((a, (first, second)), (b, (third,))))
    assert images.images == [third, own]  # prompt order: the earlier turn's, then own
    text = f"one {a} two {a} three {b} now {mine}"
    parts = images.as_parts([{"role": "user", "content": text}])[0]["content"]
    kinds = [p["type"] if p["type"] == "image" else p["text"] for p in parts]
    placeholder = f"one {EARLIER_IMAGE} two {EARLIER_IMAGE} three "
    assert kinds == [placeholder, "image", " now ", "image"]
    assert images.stored() == ((b, (third,)), (mine, (own,)))
