"""A failure stays with its requests: a request that fails part-way through joining the
batch, its prefill, joining the running rows, a verify or a commit fails alone, while
the rows running beside it finish token-identical to their solo decoding and the
server stays ready -- on plain, sliding-window, hybrid (recurrent) and MTP models.

Faults are injected with the suite's fault marker (`--inject-fault-on`, see
`engines/faults.py`): a prompt holding `FAULT@point` fails at that point of the
batched engine, after the mutation before it has begun (caches extended, a chunk
prefilled, a verify forward run), so the engine must undo it.
"""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm import load

from engines.errors import RequestFailed
from engines.request import GenerationRequest, SamplingParams
from scheduler import SchedulerState
from tests.conftest import Reference, start_scheduler
from tests.test_batched_speculation import PROMPTS, greedy_request
from tests.test_fairness import until_buffered
from tests.tiny_archs import build_tiny_arch

POINTS = ("insert", "prefill", "merge", "verify", "commit")
KINDS = ("plain", "sliding", "lfm2", "mtp")
OTHERS = 60  # tokens each of the rows beside the failing one generates


@pytest.fixture(scope="module", params=KINDS)
def served(request, tmp_path_factory, tiny_model_dir, perturbed_draft_dir):
    """(kind, a scheduler drafting in the batch with the fault marker set, mlx-lm on
    the same checkpoint)."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"contain-{kind}")
    draft = None
    if kind == "plain":
        target, draft = tiny_model_dir, perturbed_draft_dir
    elif kind == "sliding":  # a windowed target drafting with its perturbed copy
        target = build_tiny_arch("sliding", root / "t", tiny_model_dir)
        draft = build_tiny_arch("sliding", root / "d", tiny_model_dir, noise=0.05)
    elif kind == "lfm2":  # recurrent layers: a failed verify restores their state
        target, draft = build_tiny_arch("lfm2", root / "t", tiny_model_dir), perturbed_draft_dir
    else:
        target = build_tiny_arch("qwen3_5", root / "t", tiny_model_dir, mtp="copy")
    scheduler = start_scheduler(
        target, draft_model=str(draft) if draft else None, fault_marker="FAULT"
    )
    assert scheduler.rows_roll_back
    yield kind, scheduler, Reference(*load(str(target)))
    scheduler.stop()


def tokens_of(events) -> list[int]:
    return [t for event in events for t in event.token_ids]


async def test_a_failing_request_fails_alone_and_the_others_finish_exactly(served, point):
    kind, scheduler, reference = served
    encode = reference.tokenizer.encode
    prompts = [encode(PROMPTS[0]), encode(PROMPTS[1])]
    others = [
        scheduler.submit(greedy_request(f"{point}-other{i}", p, OTHERS))
        for i, p in enumerate(prompts)
    ]
    for stream in others:
        await until_buffered(stream, 2)  # both running, batched
    marker = "FAULT" if point == "commit" else f"FAULT@{point}"
    bad_prompt = encode(f"{marker}: the request that fails, {PROMPTS[2]}")
    # a logits processor keeps the batch's steps unpipelined: each is a verify
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.05)
    bad = scheduler.submit(GenerationRequest(f"{point}-bad", tuple(bad_prompt), 40, sampling))
    with pytest.raises(RequestFailed, match="injected fault"):
        await bad.collect()
    results = await asyncio.gather(*(stream.collect() for stream in others))
    for prompt, events in zip(prompts, results, strict=True):
        assert tokens_of(events) == reference.greedy_tokens(prompt, OTHERS), kind
    assert scheduler.state == SchedulerState.READY, scheduler.error
    after = encode(PROMPTS[3])
    events = await scheduler.submit(greedy_request(f"{point}-after", after, 12)).collect()
    assert tokens_of(events) == reference.greedy_tokens(after, 12)


def pytest_generate_tests(metafunc) -> None:
    if "point" in metafunc.fixturenames:
        metafunc.parametrize("point", POINTS)
