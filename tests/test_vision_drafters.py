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


async def test_a_draft_model_speculates_after_an_image_exactly(tmp_path):
    """Drafting (a text draft model, prompt lookup) runs on an image request's output
    alone and in the batch; greedy output stays mlx-vlm's. (The draft is Idefics3's
    Llama language half, perturbed.)"""
    vlm_dir = build_idefics3(tmp_path / "idefics3")
    vlm_reference = mlx_vlm_reference(vlm_dir)
    draft = build_text_draft(vlm_dir, tmp_path / "draft")
    scheduler = start_scheduler(vlm_dir, draft_model=str(draft), prefix_cache_entries=0)
    try:
        async with make_client(scheduler) as client:
            alone = await client.post(
                "/v1/chat/completions", json=chat_body([png(17)], max_tokens=40)
            )
            together = await asyncio.gather(
                client.post("/v1/chat/completions", json=chat_body([png(18)], max_tokens=40)),
                client.post("/v1/chat/completions", json=chat_body([png(19)], max_tokens=40)),
            )
    finally:
        scheduler.stop()
    assert answer(alone) == vlm_reference([png(17)], PROMPT, 40)
    assert [answer(r) for r in together] == [
        vlm_reference([png(18)], PROMPT, 40),
        vlm_reference([png(19)], PROMPT, 40),
    ]
    drafted = [r.json()["speculation"]["draft_tokens"] for r in (alone, *together)]
    assert all(count > 0 for count in drafted), drafted


async def test_the_mtp_head_drafts_after_an_image_exactly(tmp_path):
    """Qwen3.5's own MTP head drafts an image request's answer, alone and in the
    batch beside another image and a text request: greedy output stays mlx-vlm's and
    the head's drafts are accepted (its attention reads image rows at their indices,
    which only changes how well it drafts)."""
    vlm_dir = build_qwen3_5_mtp(tmp_path / "qwen3_5_mtp")
    vlm_reference = mlx_vlm_reference(vlm_dir)
    scheduler = start_scheduler(vlm_dir, prefix_cache_entries=0)
    try:
        assert scheduler.registry.mtp is not None
        async with make_client(scheduler) as client:
            alone = await client.post(
                "/v1/chat/completions", json=chat_body([png(17)], max_tokens=40)
            )
            together = await asyncio.gather(
                client.post("/v1/chat/completions", json=chat_body([png(18)], max_tokens=40)),
                client.post("/v1/chat/completions", json=chat_body([png(19)], max_tokens=40)),
                client.post("/v1/chat/completions", json=chat_body([], max_tokens=40)),
            )
    finally:
        scheduler.stop()
    assert answer(alone) == vlm_reference([png(17)], PROMPT, 40)
    assert [answer(r) for r in together] == [
        vlm_reference([png(18)], PROMPT, 40),
        vlm_reference([png(19)], PROMPT, 40),
        vlm_reference([], PROMPT, 40),
    ]
    speculation = [r.json()["speculation"] for r in (alone, *together)]
    assert all(s["accepted_tokens"] > 0 for s in speculation), speculation


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
async def test_a_feature_drafter_drafts_after_an_image_exactly(kind, tmp_path):
    """A downloaded drafter reading the target's hidden states (DFlash's block,
    EAGLE-3's chain) drafts an image request's answer on Qwen3.5, alone and in the
    batch beside another image and a text request: its features come from forwards
    that read the image, and greedy output stays mlx-vlm's. (Random drafters: their
    drafts are rejected, which exercises every rollback of the hybrid layers.)"""
    target = build_qwen3_5(tmp_path / "qwen3_5")
    drafter = (write_dflash if kind == "dflash" else write_eagle3)(tmp_path / kind, target)
    vlm_reference = mlx_vlm_reference(target)
    quiet = {"enable_pld": False, "suffix_tokens_per_key": 0, "prefix_cache_entries": 0}
    scheduler = start_scheduler(target, draft_model=str(drafter), draft_kind=kind, **quiet)
    images = ([png(17)], [png(18)], [png(19)], [])
    try:
        async with make_client(scheduler) as client:
            alone = await client.post(
                "/v1/chat/completions", json=chat_body(images[0], max_tokens=30)
            )
            together = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=chat_body(im, max_tokens=30))
                    for im in images[1:]
                )
            )
    finally:
        scheduler.stop()
    replies = (alone, *together)
    assert [answer(r) for r in replies] == [vlm_reference(im, PROMPT, 30) for im in images]
    drafted = [
        r.json()["speculation"]["by_method"].get(kind, {}).get("draft_tokens", 0) for r in replies
    ]
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
    vlm_reference = mlx_vlm_reference(target)
    quiet = {"enable_pld": False, "suffix_tokens_per_key": 0, "prefix_cache_entries": 0}
    scheduler = start_scheduler(target, draft_model=str(drafter), draft_kind="assistant", **quiet)
    images = ([png(17)], [png(18)], [png(19)])
    try:
        async with make_client(scheduler) as client:
            alone = await client.post(
                "/v1/chat/completions", json=chat_body(images[0], max_tokens=30)
            )
            together = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=chat_body(im, max_tokens=30))
                    for im in images[1:]
                )
            )
    finally:
        scheduler.stop()
    replies = (alone, *together)
    assert [answer(r) for r in replies] == [vlm_reference(im, PROMPT, 30) for im in images]
    drafted = [
        r.json()["speculation"]["by_method"].get("assistant", {}).get("draft_tokens", 0)
        for r in replies
    ]
    assert drafted[0] > 0 and drafted[1] + drafted[2] > 0, drafted
