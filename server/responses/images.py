"""A Responses request's `input_image` parts, taken out for `PromptImages` first.

Parts of messages and of tool outputs become `input_text` parts holding what stands
for the image; `server.responses.inputs` then handles them as text, in place.
"""

from __future__ import annotations

from server.errors import bad_request
from server.image_prompts import PromptImages
from server.responses.schemas import (
    FunctionCallOutputItem,
    MessageItem,
    OtherContent,
    ResponsesRequest,
    TextContent,
    ToolOutputItem,
)


def take_images(body: ResponsesRequest, images: PromptImages) -> None:
    """Every `input_image` part of the input replaced by an `input_text` part."""
    if isinstance(body.input, str):
        return
    for index, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            field, parts = "content", item.content
        elif isinstance(item, FunctionCallOutputItem | ToolOutputItem):
            field, parts = "output", item.output
        else:
            continue
        if isinstance(parts, str):
            continue
        for j, part in enumerate(parts):
            if isinstance(part, OtherContent) and part.type == "input_image":
                param = f"input[{index}].{field}[{j}]"
                parts[j] = TextContent(type="input_text", text=image_text(part, images, param))


def image_text(part: OtherContent, images: PromptImages, param: str) -> str:
    url = (part.model_extra or {}).get("image_url")
    if isinstance(url, str):
        return images.add_reference(url, f"{param}.image_url")
    if not images.reads_images:
        return images.placeholder()
    raise bad_request(f"{param} needs an image_url (a data: URL); file_id is not served", param)
