"""Prompt chunks that cover images, fed to the language model as input embeddings.

Everything else about a prompt with images is a prompt like any other: its image
tokens are ordinary ids in `prompt_tokens`, so chunking, the batch's ragged rows,
prefix-cache entries (whose scope holds the images' digests) and migration treat it
as text. Only the forward of a chunk reaching an image differs: its rows are the
text tokens' embeddings, and in an image's rows mlx-vlm's merged embeddings
(`VisionParts.stage`). The vision tower runs once per image and request, on the
engine thread, before the first chunk that reaches an image, for that image and the
prompt's later ones together (as mlx-vlm batches them: the same rounding): in the
batch and alone a layer per step (`advance_towers`). Each result waits on
the request's `Sequence` until the chunk that takes the image's last row, then goes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engines.errors import InvalidRequest
from engines.request import GenerationRequest, PromptImage
from engines.sequence import Sequence

Chunk = tuple[Sequence, int, list[int]]  # a row's sequence, its first position, its ids


def reaches(image: PromptImage, start: int, count: int) -> bool:
    """Whether prompt positions [start, start + count) hold any of `image`'s tokens."""
    return image.start < start + count and start < image.end


def covers_image(seq: Sequence, start: int, count: int) -> bool:
    return any(reaches(image, start, count) for image in seq.request.images)


def whole_images(vision: Any, seq: Sequence, start: int, stop: int) -> int:
    """Where a prompt chunk from `start` ends, so that it holds each image it reaches
    whole, for models whose image tokens attend both ways (Gemma-4): before an image
    it would cut, or past its end when the chunk starts with it. Others: `stop`."""
    if vision is None or not vision.bidirectional:
        return stop
    for image in seq.request.images:
        if image.start < stop < image.end:
            return image.start if image.start > start else image.end
    return stop


def chunk_embeddings(vision: Any, rows: list[Chunk]) -> mx.array | None:
    """Input embeddings (B, T, hidden) for rows fed their ids (padded with id 0 at the
    end to the widest, as `feed_rows` pads them), or None when no row's chunk reaches
    an image: the forward then takes ids, as for any text."""
    if not any(covers_image(seq, start, len(ids)) for seq, start, ids in rows):
        return None
    if vision is None:
        raise InvalidRequest("this model reads text only; the prompt holds images")
    width = max(len(ids) for _, _, ids in rows)
    embedded = []
    for seq, start, ids in rows:
        parts = [row_embeddings(vision, seq, start, ids)] if ids else []
        if len(ids) < width:
            parts.append(vision.embed_text([0] * (width - len(ids))))
        embedded.append(mx.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0])
    return mx.stack(embedded, axis=-3)  # (B, T, hidden), or deepstack's (1 + D, B, T, hidden)


def advance_towers(vision: Any, rows: list[Chunk]) -> set[int]:
    """One step of the vision tower (a layer of one tower batch: `TowerStages`) for
    one of the rows whose chunk reaches an image not yet embedded -- the one whose
    tower is furthest along, else the first -- and returns the rows that must wait
    another step before their chunk is fed. The batch's other rows decode meanwhile,
    so new images delay them by one layer's time at a step, however many arrive
    together, as a long prompt's chunk would."""
    needing = {
        row: index
        for row, (seq, start, ids) in enumerate(rows)
        if (index := first_missing(seq, start, len(ids))) is not None
    }
    if vision is None or not needing:
        return set()
    started = [row for row in needing if rows[row][0].image_stage is not None]
    chosen = started[0] if started else min(needing)
    seq, start, ids = rows[chosen]
    if tower_step(vision, seq, needing[chosen]) and first_missing(seq, start, len(ids)) is None:
        del needing[chosen]  # every image its chunk reaches is in: it is fed now
    return set(needing)


def tower_step(vision: Any, seq: Sequence, index: int) -> bool:
    """One step (a tower layer, or the final merge) of the embeddings of the request's
    image `index` and the later ones that fit one tower batch with it
    (`VisionParts.tower_batch`: as mlx-vlm batches a prompt's images, up to the
    operator's bound), through the vision tower together; True once they are in
    `seq.image_embeddings`."""
    if seq.image_stage is None or seq.image_stage[0] != index:
        later = [image.span for image in seq.request.images[index:]]
        seq.image_stage = (index, vision.stage(later[: vision.tower_batch(later)]))
    stages = seq.image_stage[1]
    stages.advance()
    if not stages.ready:
        return False
    seq.image_embeddings.update(enumerate(stages.result, start=index))
    seq.image_stage = None
    return True


def first_missing(seq: Sequence, start: int, count: int) -> int | None:
    """The first image the chunk [start, start + count) reaches that has no
    embeddings yet, or None."""
    for index, image in enumerate(seq.request.images):
        if reaches(image, start, count) and index not in seq.image_embeddings:
            return index
    return None


def row_embeddings(vision: Any, seq: Sequence, start: int, ids: list[int]) -> mx.array:
    """One row's embeddings for prompt positions [start, start + len(ids))."""
    end, position, parts = start + len(ids), start, []
    for index, image in enumerate(seq.request.images):
        low, high = max(image.start, start), min(image.end, end)
        if low >= high:
            continue
        if position < low:
            parts.append(vision.embed_text(ids[position - start : low - start]))
        while index not in seq.image_embeddings:  # not staged: the whole tower now
            tower_step(vision, seq, index)
        features = seq.image_embeddings[index]
        parts.append(features[..., low - image.start : high - image.start, :])
        if high == image.end:  # its last row is fed: a later chunk never needs it
            del seq.image_embeddings[index]
        position = high
    if position < end:
        parts.append(vision.embed_text(ids[position - start :]))
    return mx.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]


def check_images(request: GenerationRequest) -> None:
    """Each image's tokens inside the prompt, in order, not overlapping, and the ids
    its span says: what the embedding relies on."""
    if request.images and request.prompt_logprobs is not None:
        raise InvalidRequest("prompt_logprobs cannot score a prompt with images")
    previous = 0
    for image in request.images:
        if image.start < previous or image.end > len(request.prompt_tokens) - 1:
            raise InvalidRequest("an image's tokens fall outside the prompt or overlap")
        if list(request.prompt_tokens[image.start : image.end]) != list(image.span.ids):
            raise InvalidRequest("an image's tokens differ from the prompt's at its place")
        previous = image.end
