"""Images in chat prompts: from each surface's image parts to the model's image tokens.

Each surface first takes its request's images out of the messages (`add`): decoded
and checked (`server.images`), and replaced in the text by a sentinel unique to the
request, so the normalising, tool and template code every surface shares handles
them as text and keeps them in place. A model that reads text only gets a short
placeholder there instead (counted in `omitted`, reported to the client).

Rendering then hands the template typed parts (`as_parts`: the `{"type": "image"}`
parts vision templates expect, where the sentinels were), the template writes its
image marker for each, `expand_text` replaces each marker with the image's expansion
as mlx-vlm's processor writes it (tiles, separators, image tokens), the whole prompt
is tokenized at once as mlx-vlm tokenizes it, and `locate` finds each image's tokens
in it. The processor runs here, on the request's worker thread; the vision tower runs
later, on the engine thread, when the prefill reaches the image
(`engines.prompt_images`).
"""

from __future__ import annotations

import re
import secrets
from functools import partial
from typing import Any

import anyio.from_thread
from starlette.requests import Request
from starlette.responses import Response

from engines.model.vision import ImageExpansion, ImageSpan
from engines.request import PromptImage
from server.errors import bad_request
from server.images import (
    ImageInput,
    ImageLimits,
    check_image_count,
    image_from_base64,
    image_from_reference,
)
from server.prompts import media_placeholder

SENTINEL = "\ue000image-{}\ue001"
ANY_SENTINEL = re.compile("\ue000image-[0-9a-f]{16}\ue001")
EARLIER_IMAGE = "[image from an earlier response omitted]"


def join_blocks(texts: list[str], separator: str) -> str:
    """Text blocks joined by `separator`, but none beside an image's stand-in: an image
    block sits against its neighbours, as a template's image part does."""
    joined = ""
    for index, text in enumerate(texts):
        if index and not any(ANY_SENTINEL.fullmatch(t) for t in (text, texts[index - 1])):
            joined += separator
        joined += text
    return joined


class PromptImages:
    """One request's images in the order its messages hold them. `vision` is the
    model's `VisionParts` (None: the model reads text only). Lives with the request,
    on its worker thread."""

    def __init__(self, vision: Any, limits: ImageLimits) -> None:
        self.vision, self.limits = vision, limits
        self.sentinel = SENTINEL.format(secrets.token_hex(8))
        self.images: list[ImageInput] = []
        self.omitted = 0  # images a text-only model was sent
        # earlier requests' images a stored conversation brings back (`adopt`): per
        # stand-in, its images in order, None where one no longer fits the limit
        self.earlier: dict[str, list[ImageInput | None]] = {}
        self._expanded: list[ImageExpansion] = []

    @property
    def reads_images(self) -> bool:
        return self.vision is not None

    def placeholder(self) -> str:
        """What a text-only model reads for an image (counted)."""
        self.omitted += 1
        return media_placeholder("image")

    def add(self, image: ImageInput, param: str) -> str:
        """The text that stands for `image` in its message."""
        if self.vision is None:
            return self.placeholder()
        check_image_count(len(self.images) + 1, self.limits, param)
        self.images.append(image)
        return self.sentinel

    def add_base64(self, data: Any, media_type: Any, param: str) -> str:
        """`add` for an image sent as base64 with its media type (Anthropic's)."""
        if self.vision is None:
            return self.placeholder()
        if not isinstance(data, str) or not isinstance(media_type, str):
            raise bad_request(f"{param} needs base64 `data` and a `media_type`", param)
        return self.add(image_from_base64(data, media_type, self.limits, param), param)

    def add_reference(self, url: str, param: str) -> str:
        """`add` for an image given as a data: or http(s) URL (fetched, when the
        operator allows its host, from this worker thread through the event loop)."""
        if self.vision is None:
            return self.placeholder()
        image = anyio.from_thread.run(image_from_reference, url, self.limits, param)
        return self.add(image, param)

    def adopt(self, earlier: tuple[tuple[str, tuple[ImageInput | None, ...]], ...]) -> None:
        """Take back the images of a stored conversation (`stored`: earlier requests'
        stand-ins with their images, oldest first), which come before this request's
        own in the prompt. The newest that fit `--max-images-per-request` beside this
        request's own are read again; older ones read as a placeholder."""
        if self.vision is None or not earlier:
            return
        flat = [(sentinel, image) for sentinel, group in earlier for image in group]
        live = [k for k, (_, image) in enumerate(flat) if image is not None]
        room = max(0, self.limits.max_images - len(self.images))
        keep = set(live[len(live) - room :]) if room else set()
        for k, (sentinel, image) in enumerate(flat):
            self.earlier.setdefault(sentinel, []).append(image if k in keep else None)
        self.images[:0] = [flat[k][1] for k in sorted(keep)]

    def stored(self) -> tuple[tuple[str, tuple[ImageInput | None, ...]], ...]:
        """What a stored response keeps of the images, for `adopt`: each stand-in with
        its images in place (None: read as a placeholder from now on), the earlier
        ones' first, then this request's own."""
        adopted = sum(image is not None for group in self.earlier.values() for image in group)
        groups = [*self.earlier.items(), (self.sentinel, self.images[adopted:])]
        return tuple(
            (sentinel, tuple(images))
            for sentinel, images in groups
            if any(image is not None for image in images)
        )

    def as_parts(self, messages: list[dict]) -> list[dict]:
        """The messages with text content as typed parts, an image part where each
        sentinel was: the form vision models' chat templates read."""
        converted, seen = [], {}  # each earlier stand-in's occurrences so far
        for message in messages:
            content = message.get("content")
            if content is None or isinstance(content, str):
                parts: list[dict] = []
                # an earlier request's image (a stored Responses conversation) is read
                # again where it was adopted, else it reads as the placeholder
                content = ANY_SENTINEL.sub(partial(self._earlier, seen), content or "")
                for index, piece in enumerate(content.split(self.sentinel)):
                    if index:
                        parts.append({"type": "image"})
                    if piece:
                        parts.append({"type": "text", "text": piece})
                message = {**message, "content": parts or [{"type": "text", "text": ""}]}
            converted.append(message)
        return converted

    def _earlier(self, seen: dict[str, int], match: re.Match) -> str:
        """This request's stand-in for an adopted earlier image, in its place."""
        sentinel = match[0]
        if sentinel == self.sentinel:
            return sentinel
        images = self.earlier.get(sentinel, [])
        index = seen.get(sentinel, 0)
        seen[sentinel] = index + 1
        return self.sentinel if index < len(images) and images[index] is not None else EARLIER_IMAGE

    def expansions(self) -> list[ImageExpansion]:
        """Each image's marker expansion (the processor runs once per image)."""
        while len(self._expanded) < len(self.images):
            image = self.images[len(self._expanded)]
            self._expanded.append(self.vision.expand(image.pil()))
        return self._expanded

    def expand_text(self, text: str) -> str:
        """The template's text with its markers for the request's images, in order,
        replaced by each image's expansion (tiles, separators, image tokens), as
        mlx-vlm's processor writes it into a prompt: the whole prompt is then
        tokenized at once, as mlx-vlm tokenizes it."""
        if not self.images:
            return text
        pieces = text.split(self.vision.marker)
        expansions = self.expansions()
        expanded = [pieces[0]]
        for index, piece in enumerate(pieces[1:]):
            marker = expansions[index].text if index < len(expansions) else self.vision.marker
            expanded += [marker, piece]
        return "".join(expanded)

    def locate(self, ids: list[int]) -> tuple[PromptImage, ...]:
        """The request's images in the prompt `ids`: each from its first image token to
        its last, with its pixel inputs, in order."""
        if not self.images:
            return ()
        token = self.vision.image_token_id
        positions = [i for i, t in enumerate(ids) if t == token]
        expected = [e.image_tokens for e in self.expansions()]
        if len(positions) != sum(expected):
            raise bad_request(
                f"the chat template placed {len(positions)} image tokens where the "
                f"request's {len(self.images)} images need {sum(expected)} (an image in a "
                "turn the template drops?)",
                "messages",
            )
        located, used = [], 0
        for image, expansion in zip(self.images, self.expansions(), strict=True):
            first, last = positions[used], positions[used + expansion.image_tokens - 1]
            used += expansion.image_tokens
            span = ImageSpan(list(ids[first : last + 1]), expansion.inputs, expansion.grid)
            located.append(PromptImage(first, span, image.digest))
        return tuple(located)


OMITTED_HEADER = "x-tandem-images-omitted"


def report_omitted(request: Request, images: PromptImages, surface: str) -> None:
    """Count the images a text-only model was sent, and keep the count for the reply's
    `x-tandem-images-omitted` header (`with_omitted_header`): the model read a
    placeholder, and the client can tell."""
    request.state.images_omitted = images.omitted
    if images.omitted:
        request.app.state.metrics.count_omitted_images(surface, images.omitted)


def with_omitted_header(request: Request, response: Response) -> Response:
    count = getattr(request.state, "images_omitted", 0)
    if count:
        response.headers[OMITTED_HEADER] = str(count)
    return response
