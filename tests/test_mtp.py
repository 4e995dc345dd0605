"""Drafting with the model's own multi-token-prediction head (Qwen3.5 / Qwen3-Next).

Tiny random Qwen3.5 hybrids (gated-delta layers whose recurrent state cannot trim)
carry `mtp.*` weights beside mlx-lm's, which mlx-lm drops at load and Tandem reads
itself (`tests/tiny_archs.py`): a "copy" head that reproduces the target's own
next-token path (most drafts accepted, chains past depth one) and a "random" head
(most drafts rejected, so every rollback path runs). Greedy output equals
`mlx_lm.generate_step` token for token; sampled output is exact in distribution."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.sample_utils import make_logits_processors
from scipy.stats import chisquare

from engines.drafting.mtp import MTPState
from engines.gating.measured_costs import CostModel
from engines.model.mtp import MTPUnavailable, convert_mtp_weights, load_head, read_mtp_weights
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sample.sampling import RandomStream
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from engines.state import Drafting, SequenceState
from tests.conftest import Reference, make_client, start_scheduler
from tests.distributions import assert_same_token_distribution
from tests.test_metrics import scrape, value
from tests.tiny_archs import build_tiny_arch

STORY = "Once upon a time there was a robot who liked to read"
CODE = "def add(a, b):\n    return a + b\n" * 4
GREEDY = SamplingParams(temperature=0.0)
MTP_ONLY = SpeculationOverrides(enable_pld=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        "copy": build_tiny_arch("qwen3_5", root / "copy", tiny_model_dir, mtp="copy"),
        "random": build_tiny_arch("qwen3_5", root / "random", tiny_model_dir, mtp="random"),
        # a converted checkpoint: the config declares the head, the files lack it
        "converted": build_tiny_arch("qwen3_5", root / "converted", tiny_model_dir, seed=3),
        "next": build_tiny_arch("qwen3_next", root / "next", tiny_model_dir, mtp="random"),
    }


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, Reference]:
    return {name: Reference(*load(str(path))) for name, path in checkpoints.items()}


def make_engine(model_dir: Path, weights: Path | None = None, **config) -> SpeculativeEngine:
    registry = ModelRegistry.load(str(model_dir))
    registry.mtp = load_head(registry.target.model, registry.target.config, model_dir, weights)
    engine = SpeculativeEngine(registry, SpecConfig(**config), cost=CostModel.assumed(9))
    registry.transfer(engine.name)
    return engine


@pytest.fixture(scope="module")
def engines(checkpoints) -> dict[str, SpeculativeEngine]:
    return {name: make_engine(checkpoints[name]) for name in ("copy", "random", "next")}


def request(prompt_ids, max_tokens, sampling=GREEDY, speculation=MTP_ONLY, rid="r"):
    return GenerationRequest(
        rid, tuple(prompt_ids), max_tokens, sampling, ignore_eos=True, speculation=speculation
    )


def run(engine, req, rng=None):
    seq = make_sequence(req, engine.registry.tokenizer)
    if rng is not None:
        seq.rng = rng
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    return seq


# ---- greedy: token-identical to mlx-lm ---------------------------------------------


@pytest.mark.parametrize("prompt", [STORY, CODE])
@pytest.mark.parametrize("head", ["copy", "random", "next"])
def test_greedy_output_with_the_mtp_head_equals_mlx_lm(engines, references, head, prompt):
    engine, reference = engines[head], references[head]
    prompt_ids = reference.tokenizer.encode(prompt)
    seq = run(engine, request(prompt_ids, 240))
    assert seq.generated == reference.greedy_tokens(prompt_ids, 240)
    mtp = seq.spec.by_method["mtp"]
    assert mtp.draft_tokens > 0
    if head == "copy":  # the head mostly agrees: long accepted runs, few steps
        assert mtp.accepted_tokens > 0.5 * mtp.draft_tokens
        assert mtp.accepted_tokens > 100
    else:  # mostly rejected: each rejection restored the recurrent state and replayed
        assert mtp.accepted_tokens < mtp.draft_tokens


def test_chained_drafts_are_accepted_past_depth_one(engines, references):
    """The head drafts from its own output state, so tokens 2..k of a draft are
    accepted too, not only the first."""
    engine = engines["copy"]
    seq = run(engine, request(references["copy"].tokenizer.encode(STORY), 200))
    per_position = seq.spec.accepted_per_position
    assert len(per_position) >= 3 and per_position[1] > 10 and per_position[2] > 0


def test_mtp_and_prompt_lookup_together_equal_mlx_lm(engines, references):
    engine, reference = engines["copy"], references["copy"]
    prompt_ids = reference.tokenizer.encode(CODE)
    bias = tuple((t, 6.0) for t in sorted(set(prompt_ids))[:3])  # output that repeats
    sampling = SamplingParams(temperature=0.0, logit_bias=bias)
    seq = run(engine, request(prompt_ids, 200, sampling, SpeculationOverrides()))
    processors = make_logits_processors(logit_bias=dict(bias))
    assert seq.generated == reference.greedy_tokens(prompt_ids, 200, logits_processors=processors)
    assert seq.spec.by_method["mtp"].accepted_tokens > 0


def test_a_request_that_stops_inside_an_accepted_run_ends_exactly(engines, references):
    engine, reference = engines["copy"], references["copy"]
    prompt_ids = reference.tokenizer.encode(STORY)
    for max_tokens in (1, 2, 7, 33):
        seq = run(engine, request(prompt_ids, max_tokens))
        assert seq.generated == reference.greedy_tokens(prompt_ids, max_tokens)


# ---- migration: the head's state travels with the request -------------------------


@pytest.mark.parametrize("keep_head_state", [True, False])
def test_export_and_resume_mid_stream_is_exact_and_keeps_drafting(
    checkpoints, references, keep_head_state
):
    """Handed to another engine mid-stream -- with its head state, or without it as
    after a stretch of batched steps the head never saw -- the output is unchanged
    and the head drafts again (a missing stretch restarts its cache)."""
    reference = references["copy"]
    prompt_ids = reference.tokenizer.encode(STORY)
    first = make_engine(checkpoints["copy"])
    seq = make_sequence(request(prompt_ids, 160), first.registry.tokenizer)
    first.admit(seq)
    while len(seq.generated) < 50:
        first.step()
    state, _ = first.hand_over(seq.request_id)
    if not keep_head_state:
        drafting = Drafting(gates=state.drafting.gates, pld=state.drafting.pld)
        state = SequenceState(state.seq, state.cache, state.cached, drafting)
    drafted_before = seq.spec.by_method["mtp"].draft_tokens
    second = make_engine(checkpoints["copy"])
    second.take_over(state)
    while second.active is not None:
        second.step()
    assert seq.generated == reference.greedy_tokens(prompt_ids, 160)
    assert seq.spec.by_method["mtp"].accepted_tokens > 0
    assert seq.spec.by_method["mtp"].draft_tokens > drafted_before + 20


def test_a_gap_restarts_the_head_at_the_new_position():
    state = MTPState()
    state.observe(0, mx.zeros((5, 8)), mx.zeros((5,), dtype=mx.int32))
    assert state.next_position == 5
    state.observe(9, mx.zeros((1, 8)), mx.zeros((1,), dtype=mx.int32))
    assert (state.start, state.length, state.pending, state.next_position) == (9, 0, 1, 10)


# ---- sampling: exact in distribution ----------------------------------------------


def test_seeded_sampling_with_the_head_gives_the_plain_seeded_tokens(engines, references):
    engine = engines["copy"]
    prompt_ids = references["copy"].tokenizer.encode(STORY)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    plain = run(engine, request(prompt_ids, 80, sampling, SpeculationOverrides(num_draft_tokens=0)))
    drafted = run(engine, request(prompt_ids, 80, sampling))
    assert drafted.generated == plain.generated
    assert drafted.spec.by_method["mtp"].accepted_tokens > 0


@pytest.mark.slow
def test_sampled_tokens_with_the_head_match_plain_sampling_in_distribution(engines, references):
    """Unseeded requests go through the Leviathan rejection rule with the head's q:
    the first two tokens' distribution is that of plain sampling (two-sample chi^2).
    The first token is drafted too: the prompt's prefill fed the head."""
    engine = engines["copy"]
    prompt_ids = references["copy"].tokenizer.encode(STORY)
    trials = 1000
    params = SamplingParams(temperature=0.8, top_k=6)
    samples = {}
    for drafting, offset in ((True, 0), (False, trials)):
        overrides = MTP_ONLY if drafting else SpeculationOverrides(num_draft_tokens=0)
        samples[drafting] = [
            tuple(
                run(
                    engine,
                    request(prompt_ids, 2, params, overrides),
                    RandomStream(mx.random.key(seed + offset)),
                ).generated
            )
            for seed in range(trials)
        ]
    assert_same_token_distribution(samples[True], samples[False], positions=(0, 1))
    assert engine.totals.by_method["mtp"].accepted_tokens > 0


def test_the_heads_drafts_are_drawn_from_the_q_it_reports(engines, references):
    """Acceptance is exact only if q is the distribution each draft was drawn from
    (after temperature, top-k and the request's processors): over many draws from one
    state, the drafted tokens fit q (chi^2 goodness of fit)."""
    engine = engines["copy"]
    prompt_ids = references["copy"].tokenizer.encode(STORY)
    bias = ((prompt_ids[3], 2.0),)
    params = SamplingParams(temperature=0.9, top_k=8, logit_bias=bias)
    seq = make_sequence(request(prompt_ids, 10, params), engine.registry.tokenizer)
    engine.admit(seq)
    engine.step()  # the prompt's prefill feeds the head
    active = engine.active
    draws, q = [], None
    for seed in range(3000):
        draft = engine.drafter.propose(
            active.drafting.mtp,
            active.tokens,
            1,
            params,
            RandomStream(mx.random.key(seed)),
            active.processors,
        )
        draws.append(draft.tokens[0])
        q = draft.probs[0] if q is None else q
    engine.cancel(seq.request_id)
    support = [t for t in range(q.shape[0]) if q[t].item() > 0]
    assert 1 < len(support) <= 8
    observed = np.array([draws.count(t) for t in support])
    expected = np.array([q[t].item() for t in support]) * len(draws)
    assert sum(observed) == len(draws), "a token outside q's support was drafted"
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3


# ---- loading the head ---------------------------------------------------------------


def test_hugging_face_layout_converts_to_the_same_head(checkpoints, engines, tmp_path):
    """The original checkpoints store Qwen3-Next's RMSNorm weights as offsets from 1,
    experts one tensor each, and their conv1d unmoved: read from such files, the head
    is the one mlx-lm's layout gives."""
    head = engines["next"].registry.mtp
    hf = {}
    for key, array in tree_flatten(head.parameters()):
        if "switch_mlp" in key:
            layer_prefix, name = key.split(".switch_mlp.")
            for e in range(array.shape[0]):
                hf[f"mtp.{layer_prefix}.experts.{e}.{name}"] = array[e]
        elif key.endswith("norm.weight") and array.ndim == 1:
            hf[f"mtp.{key}"] = array - 1.0
        else:
            hf[f"mtp.{key}"] = array
    hf["model.layers.0.linear_attn.conv1d.weight"] = mx.zeros((8, 1, 4))  # HF: (C, 1, K)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), hf)
    raw, unsanitized = read_mtp_weights(tmp_path)
    assert unsanitized
    converted = convert_mtp_weights(raw, offset_norms=True)
    expected = dict(tree_flatten(head.parameters()))
    assert sorted(converted) == sorted(expected)
    for key, array in expected.items():
        assert mx.allclose(converted[key], array, atol=1e-6).item(), key


def test_a_converted_checkpoint_without_the_head_says_what_to_do(checkpoints):
    registry = ModelRegistry.load(str(checkpoints["converted"]))
    with pytest.raises(MTPUnavailable, match="--mtp-weights"):
        load_head(registry.target.model, registry.target.config, checkpoints["converted"])


def test_mtp_weights_from_another_file_draft_for_a_converted_checkpoint(
    checkpoints, references, tmp_path
):
    weights = tmp_path / "mtp.safetensors"
    source = mx.load(str(checkpoints["random"] / "model.safetensors"))
    mx.save_safetensors(str(weights), {k: v for k, v in source.items() if k.startswith("mtp.")})
    engine = make_engine(checkpoints["converted"], weights)
    prompt_ids = references["converted"].tokenizer.encode(STORY)
    seq = run(engine, request(prompt_ids, 120))
    assert seq.generated == references["converted"].greedy_tokens(prompt_ids, 120)
    assert seq.spec.by_method["mtp"].draft_tokens > 0


def test_a_quantized_conversion_drafts_with_the_originals_head(checkpoints, tmp_path):
    """What users of mlx-community checkpoints have: `mlx_lm.convert -q` dropped the head
    and quantized the model. With --mtp-weights naming the original, the float head
    drafts on the quantized target's embedding and LM head, exactly."""
    from mlx_lm import convert

    quantized = tmp_path / "q4"
    convert(str(checkpoints["copy"]), mlx_path=str(quantized), quantize=True, q_group_size=32)
    assert not any("mtp." in key for key in mx.load(str(quantized / "model.safetensors")))
    engine = make_engine(quantized, checkpoints["copy"])
    reference = Reference(*load(str(quantized)))
    prompt_ids = reference.tokenizer.encode(STORY)
    seq = run(engine, request(prompt_ids, 120))
    assert seq.generated == reference.greedy_tokens(prompt_ids, 120)
    assert seq.spec.by_method["mtp"].accepted_tokens > 0.3 * seq.spec.by_method["mtp"].draft_tokens


def test_missing_mtp_weights_are_refused_with_the_path(tmp_path):
    from engines.model.mtp import weights_source

    with pytest.raises(MTPUnavailable, match="no file or folder"):
        weights_source(str(tmp_path / "nothing-here"))


# ---- served: the scheduler, HTTP, metrics -------------------------------------------


@pytest.fixture(scope="module")
def served(checkpoints):
    scheduler = start_scheduler(checkpoints["copy"])
    yield scheduler
    scheduler.stop()


async def test_served_greedy_completion_drafts_with_mtp_and_metrics_say_so(served, references):
    reference = references["copy"]
    prompt_ids = reference.tokenizer.encode(STORY)
    async with make_client(served) as client:
        before = await scrape(client)
        response = await client.post(
            "/v1/completions",
            json={
                "prompt": prompt_ids,
                "max_tokens": 120,
                "temperature": 0,
                "ignore_eos": True,
                "enable_pld": False,
            },
        )
        assert response.status_code == 200, response.text
        after = await scrape(client)
        stats = (await client.get("/v1/stats")).json()
    detokenizer = reference.tokenizer.detokenizer  # the streaming detokenizer, as served
    detokenizer.reset()
    for token in reference.greedy_tokens(prompt_ids, 120):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert response.json()["choices"][0]["text"] == detokenizer.text
    assert value(after, "tandem_drafter_active", drafter="mtp") == 1.0
    assert value(after, "tandem_drafter_active", drafter="draft") == 0.0
    drafted = value(after, "tandem_spec_draft_tokens_total", method="mtp") - value(
        before, "tandem_spec_draft_tokens_total", method="mtp"
    )
    assert drafted > 0
    assert "mtp" in stats["speculation"]["drafters"]


async def test_concurrent_requests_are_exact_and_a_later_one_drafts_again(served, references):
    """Beside other requests the hybrid is batched (its head drafting there too, see
    test_batched_mtp.py); each output is still its solo greedy decoding, and the next
    request alone drafts with the head again."""
    reference = references["copy"]
    prompts = [reference.tokenizer.encode(p) for p in (STORY, CODE, "Hello there, friend")]
    streams = [served.submit(request(p, 60 + 20 * i, rid=f"c{i}")) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(s.collect() for s in streams))
    for prompt_ids, events, i in zip(prompts, results, range(3), strict=True):
        tokens = [t for event in events for t in event.token_ids]
        assert tokens == reference.greedy_tokens(prompt_ids, 60 + 20 * i)
    events = await served.submit(request(prompts[0], 80, rid="after")).collect()
    assert [t for e in events for t in e.token_ids] == reference.greedy_tokens(prompts[0], 80)
    assert events[-1].speculation["by_method"]["mtp"]["accepted_tokens"] > 0


async def test_structured_output_drafted_by_the_head_equals_plain_constrained_decoding(
    served, references
):
    """The grammar constrains the head's drafts as it does the target's tokens (the
    head samples from its processed distribution): the JSON is plain constrained
    decoding's, token for token, and parses."""
    from tests.test_structured_outputs import (
        json_request,
        matches_schema,
        reference_json_tokens,
        text_of,
    )

    reference = references["copy"]
    before = served.speculative_engine.totals.by_method.get("mtp")
    drafted_before = before.draft_tokens if before else 0
    for i, text in enumerate(("Describe the ball as JSON.", "The weather today")):
        prompt = reference.tokenizer.encode(text)
        events = await served.submit(json_request(served, f"json{i}", prompt)).collect()
        tokens = [t for event in events for t in event.token_ids]
        assert tokens == reference_json_tokens(reference, prompt, 64)
        assert matches_schema(json.loads(text_of(reference, tokens)))
    assert served.speculative_engine.totals.by_method["mtp"].draft_tokens > drafted_before


async def test_no_mtp_and_a_headless_checkpoint_serve_without_it(checkpoints, references):
    for path, overrides in ((checkpoints["copy"], {"mtp": False}), (checkpoints["converted"], {})):
        scheduler = start_scheduler(path, **overrides)
        try:
            assert scheduler.drafters == ["pld", "suffix"]
            assert scheduler.speculative_engine.registry.mtp is None
        finally:
            scheduler.stop()


def test_the_cli_flags_reach_the_scheduler():
    from server.cli import build_parser
    from server.serve import build_config

    args = build_parser().parse_args(["serve", "m", "--no-mtp", "--mtp-weights", "/w"])
    config = build_config(args).scheduler
    assert (config.mtp, config.mtp_weights) == (False, "/w")
    default = build_config(build_parser().parse_args(["serve", "m"])).scheduler
    assert (default.mtp, default.mtp_weights) == (True, None)


def test_bench_spec_runs_the_mtp_configs_and_checks_them_against_mlx_lm(checkpoints, capsys):
    """`tandem bench spec MODEL --mtp`, as it runs on a Mac on real weights: every
    output checked against mlx-lm's, the head's drafts and acceptance reported."""
    from bench import spec

    table = spec.main(
        [
            str(checkpoints["copy"]),
            "--mtp",
            "--sets",
            "novel",
            "--limit",
            "1",
            "--max-tokens",
            "40",
            "--configs",
            "mlx-lm,plain,mtp,mtp+pld",
        ]
    )
    rows = table["novel"]
    assert set(rows) == {"mlx-lm", "plain", "mtp", "mtp+pld"}
    assert all(row["greedy_mismatches"] == 0 for row in rows.values())
    # the engine measured its costs like a fresh server: on a model this small the head
    # costs nearly a plain step, so it drafts rarely, but it does draft
    assert rows["mtp"]["drafted"]["mtp"] > 0
    assert "mtp     the model's own head" in capsys.readouterr().out
