"""A failure stays with its requests: a request that fails part-way through joining the
batch, its prefill, joining the running rows, a verify or a commit fails alone, while
the rows running beside it finish token-identical to their solo decoding and the
server stays ready -- on plain, sliding-window, hybrid (recurrent) and MTP models. A
failure while drafting fails no request: the rows it belongs to (the one whose draft
or lookup proposal failed; every row a failed batched draft forward fed) go on without
that drafter, every row token-identical too.

Faults are injected with the suite's fault marker (`--inject-fault-on`, see
`engines/faults.py`): a prompt holding `FAULT@point` fails at that point of the
batched engine, after the mutation before it has begun (caches extended, a chunk
prefilled, a verify forward run), so the engine must undo it.
"""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm import load
from mlx_lm.sample_utils import make_logits_processors

from bench.drafter_checkpoints import write_dflash
from engines.batched.engine import BatchedSpeculativeEngine
from engines.drafting.feature_drafters import load_feature_drafter
from engines.errors import RequestFailed
from engines.model.mtp import load_head
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from scheduler import SchedulerState
from tests.conftest import Reference, start_scheduler
from tests.test_batched_speculation import COST, PROMPTS, greedy_request
from tests.test_fairness import until_buffered
from tests.tiny_archs import build_tiny_arch

POINTS = ("insert", "prefill", "merge", "verify", "commit")
DRAFT_POINTS = ("draft", "lookup")  # what stops drafting for a row, not its request
KINDS = ("plain", "sliding", "lfm2", "mtp", "dflash")
OTHERS = 60  # tokens each of the rows beside the failing one generates


def checkpoints(kind: str, root, tiny_model_dir, perturbed_draft_dir):
    """(target, draft model or None) of a kind; the MTP kind's head is in its target."""
    if kind == "plain":
        return tiny_model_dir, perturbed_draft_dir
    if kind == "sliding":  # a windowed target drafting with its perturbed copy
        target = build_tiny_arch("sliding", root / "t", tiny_model_dir)
        return target, build_tiny_arch("sliding", root / "d", tiny_model_dir, noise=0.05)
    if kind == "lfm2":  # recurrent layers: a failed verify restores their state
        return build_tiny_arch("lfm2", root / "t", tiny_model_dir), perturbed_draft_dir
    if kind == "dflash":  # a drafter fed the target's layers, one ragged forward per draft
        return tiny_model_dir, write_dflash(root / "d", tiny_model_dir)
    return build_tiny_arch("qwen3_5", root / "t", tiny_model_dir, mtp="copy"), None


@pytest.fixture(scope="module", params=KINDS)
def served(request, tmp_path_factory, tiny_model_dir, perturbed_draft_dir):
    """(kind, a scheduler drafting in the batch with the fault marker set, mlx-lm on
    the same checkpoint). Drafting is cheap (`COST`), so three rows draft together."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"contain-{kind}")
    target, draft = checkpoints(kind, root, tiny_model_dir, perturbed_draft_dir)
    scheduler = start_scheduler(
        target, draft_model=str(draft) if draft else None, fault_marker="FAULT", cost_model=COST
    )
    assert scheduler.rows_roll_back
    yield kind, scheduler, Reference(*load(str(target)))
    scheduler.stop()


@pytest.fixture(scope="module", params=KINDS)
def drafting_engine(request, tmp_path_factory, tiny_model_dir, perturbed_draft_dir):
    """(kind, a batched engine drafting with its model drafter, mlx-lm on its target)."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"draft-fails-{kind}")
    target, draft = checkpoints(kind, root, tiny_model_dir, perturbed_draft_dir)
    if kind == "dflash":
        registry = ModelRegistry.load(str(target))
        registry.feature_drafter = load_feature_drafter(str(draft), kind, registry.target)
    else:
        registry = ModelRegistry.load(str(target), str(draft) if draft else None)
    if kind == "mtp":
        registry.mtp = load_head(registry.target.model, registry.target.config, target)
    spec = SpeculativeEngine(registry, SpecConfig(), cost=COST)
    engine = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64)
    registry.transfer(engine.name)
    yield kind, engine, Reference(*load(str(target)))
    engine.close()


class FailingForward:
    """A model drafter's model (the draft model, the MTP head, DFlash's forward) whose
    next call raises once armed, with no row to blame: a batched draft forward that
    failed. Counts the calls after that one."""

    def __init__(self, model) -> None:
        self.model = model
        self.armed = False
        self.failed = False
        self.calls_after = 0

    def __call__(self, *args, **kwargs):
        if self.failed:
            self.calls_after += 1
        elif self.armed:
            self.failed = True
            raise RuntimeError("the draft forward failed")
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def tokens_of(events) -> list[int]:
    return [t for event in events for t in event.token_ids]


async def two_decoding(scheduler, reference, tag: str) -> tuple[list[list[int]], list]:
    """Two greedy requests running (batched) before the one that fails joins them."""
    prompts = [reference.tokenizer.encode(PROMPTS[0]), reference.tokenizer.encode(PROMPTS[1])]
    others = [
        scheduler.submit(greedy_request(f"{tag}-other{i}", p, OTHERS))
        for i, p in enumerate(prompts)
    ]
    for stream in others:
        await until_buffered(stream, 2)  # both running, batched
    return prompts, others


async def test_a_failing_request_fails_alone_and_the_others_finish_exactly(served, point):
    kind, scheduler, reference = served
    encode = reference.tokenizer.encode
    prompts, others = await two_decoding(scheduler, reference, point)
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


async def test_a_request_whose_drafter_fails_goes_on_without_it_and_every_row_is_exact(
    served, draft_point
):
    kind, scheduler, reference = served
    encode = reference.tokenizer.encode
    prompts, others = await two_decoding(scheduler, reference, draft_point)
    bad_prompt = encode(f"FAULT@{draft_point}: a request whose drafter fails, {PROMPTS[2]}")
    # a logits processor keeps the batch's steps unpipelined (each a verify) and makes
    # the row draft with its own processors
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.05)
    request = GenerationRequest(
        f"{draft_point}-bad", tuple(bad_prompt), 40, sampling, ignore_eos=True
    )
    events = await scheduler.submit(request).collect()
    processors = make_logits_processors(repetition_penalty=1.05)
    solo = reference.greedy_tokens(bad_prompt, 40, logits_processors=processors)
    assert tokens_of(events) == solo, kind
    speculation = events[-1].speculation
    assert speculation["gate_trips"].get("failure", 0) >= 1, speculation  # the fault fired
    failed = ("pld", "suffix") if draft_point == "lookup" else ("draft", "mtp")
    assert not set(failed) & set(speculation["by_method"]), speculation  # nothing after
    results = await asyncio.gather(*(stream.collect() for stream in others))
    for prompt, events in zip(prompts, results, strict=True):
        assert tokens_of(events) == reference.greedy_tokens(prompt, OTHERS), kind
    assert scheduler.state == SchedulerState.READY, scheduler.error


def test_a_draft_forward_that_fails_with_no_row_to_blame_stops_model_drafting_for_its_rows(
    drafting_engine,
):
    """Three rows decode together; their next batched draft forward raises. Each row
    it fed stops drafting with the model drafter (one failure each, no model forward
    after it), and every row still finishes token-identical to mlx-lm's greedy."""
    kind, engine, reference = drafting_engine
    # the MTP head is its single-stream drafter's (the batch's rows ask it what to compute);
    # DFlash's forward is its module's draft_logits
    drafter, name = engine.model_drafter, "model"
    if kind == "mtp":
        drafter, name = drafter.drafter, "head"
    elif kind == "dflash":
        drafter, name = drafter.module, "draft_logits"
    failing = FailingForward(getattr(drafter, name))
    setattr(drafter, name, failing)
    prompts = [reference.tokenizer.encode(text) for text in PROMPTS[:3]]
    requests = [greedy_request(f"unblamed{i}", p, 40) for i, p in enumerate(prompts)]
    seqs = [make_sequence(r, engine.registry.tokenizer) for r in requests]
    outputs = []
    try:
        for seq in seqs:
            engine.admit(seq)
        while len(engine.rows) < len(seqs):  # all three decoding, batched
            outputs += engine.step().outputs
        failing.armed = True
        while engine.batch_size:
            outputs += engine.step().outputs
    finally:
        setattr(drafter, name, failing.model)
    assert failing.failed, kind
    assert failing.calls_after == 0, kind
    assert not [o.error for o in outputs if o.error], kind
    for request, seq in zip(requests, seqs, strict=True):
        tokens = [t for o in outputs if o.request_id == request.request_id for t in o.token_ids]
        assert tokens == reference.greedy_tokens(list(request.prompt_tokens), 40), kind
        assert seq.spec.gate_trips.get("failure") == 1, (kind, seq.spec.as_dict())


def pytest_generate_tests(metafunc) -> None:
    if "point" in metafunc.fixturenames:
        metafunc.parametrize("point", POINTS)
    if "draft_point" in metafunc.fixturenames:
        metafunc.parametrize("draft_point", DRAFT_POINTS)
