"""A Messages request's image blocks, taken out for `PromptImages` before rendering.

Image blocks in user turns and in tool results (Claude Code's Read tool returns a
screenshot so) become text blocks holding what stands for the image; the rest of
the Messages prompt code then handles them as text, in place.
"""

from __future__ import annotations

from typing import Any

from server.anthropic.schemas import MessagesPrompt, OtherBlock, TextBlock, ToolResultBlock
from server.errors import bad_request
from server.image_prompts import PromptImages


def take_images(body: MessagesPrompt, images: PromptImages) -> None:
    """Every image block of a user turn (and of its tool results) replaced by a text
    block with the image's stand-in."""
    for index, message in enumerate(body.messages):
        if message.role != "user":
            continue
        for j, block in enumerate(message.content):
            where = f"messages[{index}].content[{j}]"
            if is_image(block):
                message.content[j] = TextBlock(type="text", text=image_text(block, images, where))
            elif isinstance(block, ToolResultBlock):
                for k, inner in enumerate(block.content):
                    if is_image(inner):
                        text = image_text(inner, images, f"{where}.content[{k}]")
                        block.content[k] = TextBlock(type="text", text=text)


def is_image(block: Any) -> bool:
    return isinstance(block, OtherBlock) and block.type == "image"


def image_text(block: OtherBlock, images: PromptImages, where: str) -> str:
    """The stand-in for one image block: its `source` decoded and checked."""
    source = (block.model_extra or {}).get("source")
    param = f"{where}.source"
    if not isinstance(source, dict):
        raise bad_request(f"{param} must be an object with a type", param)
    kind = source.get("type")
    if kind == "base64":
        return images.add_base64(source.get("data"), source.get("media_type"), param)
    if kind == "url" and isinstance(source.get("url"), str):
        return images.add_reference(source["url"], param)
    if not images.reads_images:
        return images.placeholder()
    raise bad_request(
        f"{param} has type {kind!r}; this server reads images sent as base64 or a url",
        param,
    )
