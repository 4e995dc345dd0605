"""Qwen3.5 / Qwen3.6 reading images (`engines.model.qwen35_images`): the drafters its
users run -- the model's own MTP head and downloaded feature drafters -- draft image
requests exactly, and mlx-vlm's quantized conversion of the MoE loads as it says.
(The family's own serving tests are `tests/test_vision.py`'s, for every family.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import make_client, start_scheduler
from tests.test_vision import PROMPT, answer, chat_body, mlx_vlm_reference
from tests.vlm_models import build_qwen3_5, build_qwen3_5_moe, build_qwen3_5_mtp, png


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


async def test_a_quantized_qwen3_5_moe_keeps_its_8_bit_gates(tmp_path):
    """mlx-vlm's own 4-bit conversion of Qwen3.5-MoE keeps its routers' gates at 8
    bits (per-layer settings in the config): the language half is quantized layer by
    layer as the checkpoint says, loads, and reads an image as mlx-vlm does."""
    from mlx_vlm.convert import convert

    source = build_qwen3_5_moe(tmp_path / "source")
    quantized = tmp_path / "quantized"
    convert(str(source), str(quantized), quantize=True, q_group_size=32, q_bits=4)
    settings = json.loads((quantized / "config.json").read_text())["quantization"]
    assert settings["language_model.model.layers.0.mlp.gate"]["bits"] == 8
    scheduler = start_scheduler(quantized)
    try:
        async with make_client(scheduler) as client:
            reply = await client.post("/v1/chat/completions", json=chat_body([png(3)]))
    finally:
        scheduler.stop()
    assert answer(reply) == mlx_vlm_reference(quantized)([png(3)], PROMPT, 12)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
async def test_a_feature_drafter_drafts_after_an_image_exactly(kind, tmp_path):
    """A downloaded drafter reading the target's hidden states (DFlash's block,
    EAGLE-3's chain) drafts an image request's answer on Qwen3.5, alone and in the
    batch beside another image and a text request: its features come from forwards
    that read the image, and greedy output stays mlx-vlm's. (Random drafters: their
    drafts are rejected, which exercises every rollback of the hybrid layers.)"""
    from bench.drafter_checkpoints import write_dflash, write_eagle3

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
