"""The drafters users run, drafting the answers of image requests exactly: a text
draft model (`--draft-model`), Qwen3.5's own MTP head, downloaded drafters reading the
target's hidden states (DFlash, EAGLE-3), and Gemma-4's assistant -- alone and in the
batch, greedy output equal to mlx-vlm's `generate`, and each drafter really drafted.
(Random drafters: most drafts are rejected, which runs every rollback.)"""

from __future__ import annotations

import asyncio

import pytest

from bench.drafter_checkpoints import write_assistant, write_dflash, write_eagle3
from tests.conftest import make_client, start_scheduler
from tests.test_vision import PROMPT, answer, chat_body, mlx_vlm_reference
from tests.vlm_models import (
    build_gemma4,
    build_idefics3,
    build_qwen3_5,
    build_qwen3_5_mtp,
    build_text_draft,
    png,
)


async def served_alone_and_batched(target, images: list, max_tokens: int, **config) -> list:
    """Serve `images[0]`'s request alone, then the others' at once (each entry: one
    request's images, [] for text) on a scheduler with `config`; assert every answer
    is mlx-vlm's, and return each request's speculation counts."""
    vlm_reference = mlx_vlm_reference(target)
    scheduler = start_scheduler(target, prefix_cache_entries=0, **config)
    try:
        async with make_client(scheduler) as client:
            first = chat_body(images[0], max_tokens=max_tokens)
            alone = await client.post("/v1/chat/completions", json=first)
            together = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=chat_body(im, max_tokens=max_tokens))
                    for im in images[1:]
                )
            )
    finally:
        scheduler.stop()
    replies = (alone, *together)
    expected = [vlm_reference(im, PROMPT, max_tokens) for im in images]
    assert [answer(r) for r in replies] == expected
    return [r.json()["speculation"] for r in replies]


def by(kind: str, speculation: list, count: str = "draft_tokens") -> list[int]:
    return [s["by_method"].get(kind, {}).get(count, 0) for s in speculation]


# drafting by the drafter under test only (no prompt lookup or suffix drafts)
QUIET = {"enable_pld": False, "suffix_tokens_per_key": 0}


async def test_a_draft_model_speculates_after_an_image_exactly(tmp_path):
    """Drafting (a text draft model, prompt lookup) runs on an image request's output
    alone and in the batch; greedy output stays mlx-vlm's. (The draft is Idefics3's
    Llama language half, perturbed.)"""
    vlm_dir = build_idefics3(tmp_path / "idefics3")
    draft = build_text_draft(vlm_dir, tmp_path / "draft")
    images = [[png(17)], [png(18)], [png(19)]]
    speculation = await served_alone_and_batched(vlm_dir, images, 40, draft_model=str(draft))
    assert all(s["draft_tokens"] > 0 for s in speculation), speculation


async def test_the_mtp_head_drafts_after_an_image_exactly(tmp_path):
    """Qwen3.5's own MTP head drafts an image request's answer, alone and in the
    batch beside another image and a text request: greedy output stays mlx-vlm's, and
    the head drafts (its attention reads image rows at their indices, which only
    changes how well: alone 6 of 17 of its drafts were accepted)."""
    vlm_dir = build_qwen3_5_mtp(tmp_path / "qwen3_5_mtp")
    images = [[png(17)], [png(18)], [png(19)], []]
    speculation = await served_alone_and_batched(vlm_dir, images, 40, **QUIET)
    assert by("mtp", speculation, "accepted_tokens")[0] > 0, speculation  # alone
    drafted = by("mtp", speculation)
    assert drafted[1] + drafted[2] > 0, speculation  # and for the batch's image rows


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
async def test_a_feature_drafter_drafts_after_an_image_exactly(kind, tmp_path):
    """A downloaded drafter reading the target's hidden states (DFlash's block,
    EAGLE-3's chain) drafts an image request's answer on Qwen3.5, alone and in the
    batch beside another image and a text request: its features come from forwards
    that read the image, and greedy output stays mlx-vlm's. (Random drafters: their
    drafts are rejected, which exercises every rollback of the hybrid layers.)"""
    target = build_qwen3_5(tmp_path / "qwen3_5")
    drafter = (write_dflash if kind == "dflash" else write_eagle3)(tmp_path / kind, target)
    images = [[png(17)], [png(18)], [png(19)], []]
    config = {"draft_model": str(drafter), "draft_kind": kind, **QUIET}
    drafted = by(kind, await served_alone_and_batched(target, images, 30, **config))
    # alone, and for the batch's image rows (a row whose drafts all fail may close its
    # gate before it drafts: the other image row then drafted)
    assert drafted[0] > 0 and drafted[1] + drafted[2] > 0, drafted


async def test_gemma4s_assistant_drafts_after_an_image_exactly(tmp_path):
    """Gemma-4's `-assistant` drafter (it reads the target's last hidden state and
    its shared KV) drafts image requests on Gemma-4, alone and batched: greedy output
    stays mlx-vlm's and it drafted. (Image rows only: with this test template, which
    has no begin-of-text token, mlx-vlm's generate encodes a text-only prompt without
    one, where every server, mlx-lm's too, adds it.)"""
    target = build_gemma4(tmp_path / "gemma4")
    drafter = write_assistant(tmp_path / "assistant", target)
    images = [[png(17)], [png(18)], [png(19)]]
    config = {"draft_model": str(drafter), "draft_kind": "assistant", **QUIET}
    drafted = by("assistant", await served_alone_and_batched(target, images, 30, **config))
    assert drafted[0] > 0 and drafted[1] + drafted[2] > 0, drafted
