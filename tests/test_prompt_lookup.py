"""Prompt lookup that follows a copy through edits (`engines.drafting.prompt_lookup`).

Unit tests drive `CopyLookup` with token ids standing for an edited copy of a prompt;
the engine test serves a scripted rename of a code prompt through the real speculative
engine (a tiny model forced to write the script, as `tests.forcing` does) and checks the
output is the script and that long lookup drafts were accepted through the renames."""

from __future__ import annotations

import pytest

from engines.drafting.draft import PLD
from engines.drafting.prompt_lookup import MAX_SUBSTITUTIONS, CopyLookup
from engines.gating.gates import MethodGate, prompt_repetition_score
from engines.gating.measured_costs import CostModel
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from tests.forcing import forced_tokens_processor

OLD, NEW = [50, 51], [60, 61, 62]  # a renamed identifier: two tokens became three
# the source: lines that use the old name, each followed by different code
SOURCE = [1, 2, *OLD, 3, 4, 5, 6, 7, *OLD, 8, 9, 10, 11, 12, 13, *OLD, 14, 15, 16, 17, 18, 19]
INSTRUCTION = [90, 91, *OLD, 92, *NEW, 93]  # "rename OLD to NEW:"


def renamed(tokens: list[int]) -> list[int]:
    out, i = [], 0
    while i < len(tokens):
        if tokens[i : i + len(OLD)] == OLD:
            out.extend(NEW)
            i += len(OLD)
        else:
            out.append(tokens[i])
            i += 1
    return out


def written(lookup: CopyLookup, prompt: list[int], answer: list[int]) -> list[int]:
    """Serve `answer` token by token, as verifies that accept what matches would:
    at each position the tokens the lookup's proposal got right."""
    accepted = []
    for position in range(len(answer)):
        found = lookup.propose(prompt + answer[:position], 8)
        right = 0
        for offset, token in enumerate(found[1] if found else []):
            if position + offset >= len(answer) or answer[position + offset] != token:
                break
            right += 1
        accepted.append(right)
    return accepted


def test_a_rename_is_learned_and_written_into_later_copies():
    prompt = INSTRUCTION + SOURCE
    answer = renamed(SOURCE)
    lookup = CopyLookup()
    accepted = written(lookup, prompt, answer)
    assert lookup.substitutions == {tuple(OLD): tuple(NEW)}
    second = answer.index(NEW[0], answer.index(NEW[0]) + 1)  # the second renamed use
    # proposed a few tokens before it, the draft runs through the new name
    assert accepted[second - 2] >= 2 + len(NEW) + 1
    plain = written(_LatestOnly(), prompt, answer)
    assert sum(accepted) > sum(plain) + 8, (accepted, plain)


class _LatestOnly(CopyLookup):
    """Plain prompt lookup (the latest occurrence, no substitutions): the baseline."""

    def _learn_substitution(self, n: int, start: int) -> None:
        pass

    def _follow_copy(self) -> None:
        return None


def test_after_a_change_the_copy_resumes_at_its_own_line_not_the_latest_match():
    # two lines share the token 7; the output copies line one, changes its 3 to 30 and
    # writes 7: the copy resumes on line one, not after the latest 7 (line two)
    prompt = [1, 2, 3, 7, 4, 5, 6, 8, 7, 9, 9, 9]
    lookup = CopyLookup()
    assert lookup.propose(prompt + [1], 4) == (1, [2, 3, 7, 4])
    assert lookup.propose(prompt + [1, 2], 4) == (2, [3, 7, 4, 5])  # the copy runs
    assert lookup.propose(prompt + [1, 2, 30, 7], 3) == (1, [4, 5, 6])
    assert lookup.substitutions == {(3,): (30,)}
    assert _LatestOnly().propose(prompt + [1, 2, 30, 7], 3) == (1, [9, 9, 9])


def test_a_substitution_rejected_at_its_first_token_is_forgotten():
    prompt = INSTRUCTION + SOURCE
    answer = renamed(SOURCE)
    lookup = CopyLookup()
    first_use = answer.index(NEW[0])
    written(lookup, prompt, answer[: first_use + len(NEW) + 3])
    assert tuple(OLD) in lookup.substitutions
    # the output keeps the old name at its second use (say, inside a string)
    kept = answer[: first_use + len(NEW) + 3] + [8, 9, 10, 11, 12, 13]
    found = lookup.propose(prompt + kept, 4)
    assert found is not None and found[1][: len(NEW)] == NEW
    lookup.propose(prompt + kept + [OLD[0]], 4)
    assert tuple(OLD) not in lookup.substitutions


def test_periodic_text_still_continues_past_the_end_of_the_context():
    lookup = CopyLookup()
    assert lookup.propose([5, 1, 2, 3, 1, 2, 3, 1], 7) == (3, [2, 3, 1, 2, 3, 1, 2])


def test_substitutions_are_bounded_and_a_shorter_context_starts_over():
    lines = MAX_SUBSTITUTIONS + 5  # each line's first token is renamed
    source = [t for i in range(lines) for t in (1000 + i, 1, 2000 + i, 3)]
    answer = [t for i in range(lines) for t in (5000 + i, 1, 2000 + i, 3)]
    lookup = CopyLookup()
    written(lookup, [7, 8, *source], answer)
    assert len(lookup.substitutions) == MAX_SUBSTITUTIONS
    assert lookup.substitutions[(1000 + lines - 1,)] == (5000 + lines - 1,)
    assert (1000,) not in lookup.substitutions  # the oldest went first
    lookup.propose([1, 2, 3], 4)  # another context (a rebuild): nothing carried over
    assert lookup.tokens == [1, 2, 3] and lookup.substitutions == {}


CODE = """def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.count
    if subtotal > 100:
        subtotal = subtotal * 0.9
    return round(subtotal * (1 + tax), 2)
"""


def test_a_scripted_rename_is_served_exactly_with_long_drafts_through_it(tiny_model_dir):
    """A request alone drafts prompt lookup past the batch's 8 tokens, through the
    renamed variable, and the output is exactly the script."""
    registry = ModelRegistry.load(str(tiny_model_dir))
    engine = SpeculativeEngine(registry, SpecConfig(), cost=CostModel.assumed(9))
    registry.transfer(engine.name)
    tokenizer = registry.tokenizer
    prompt = tokenizer.encode("Rename subtotal to amount:\n" + CODE + "\nAnswer:\n")
    script = tokenizer.encode(CODE.replace("subtotal", "amount"))
    request = GenerationRequest("r", tuple(prompt), len(script), SamplingParams(temperature=0))
    seq = make_sequence(request, tokenizer)
    seq.processors.append(forced_tokens_processor(len(prompt), script))
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    assert seq.generated == script
    per_position = seq.spec.accepted_per_position
    assert len(per_position) > 8 and per_position[8] > 0  # a ninth lookup token accepted
    assert seq.spec.accepted_tokens >= len(script) // 2, seq.spec


def test_lookup_rates_are_learned_per_match_length_at_every_position():
    """Code edits: a three-token match's draft is right along the whole copy, a
    one-token match's is right for a token or two. Rates pooled past the first position
    would draft the weak match as long as the strong one."""
    cost = CostModel((1.0, 1.1, 1.2, 1.3, 1.35, 1.4, 1.45, 1.5, 1.55))
    gate = MethodGate(PLD, alpha=0.5)
    for _ in range(12):
        gate.record(8, 8, 8, cost, match=3)  # whole copies
        gate.record(8, 1, 8, cost, match=1)  # the first token, then wrong
        gate.record(8, 0, 8, cost, match=1)
    strong, weak = gate.acceptance(3), gate.acceptance(1)
    assert min(strong) > 0.85
    assert weak[0] == pytest.approx(0.5, abs=0.1) and weak[1] < 0.2
    assert gate.draft_length(8, cost, match=3) == 8
    assert gate.draft_length(8, cost, match=1) <= 1


def test_a_prompt_that_does_not_repeat_itself_still_drafts_when_the_answer_copies_it(
    tiny_model_dir,
):
    """The prompt gate starts lookup closed on a prompt that does not repeat itself, but
    its first strong match probes at once: an answer that copies the prompt from its
    first token is drafted from its first tokens, not after a back-off of plain steps."""
    registry = ModelRegistry.load(str(tiny_model_dir))
    engine = SpeculativeEngine(registry, SpecConfig(), cost=CostModel.assumed(9))
    registry.transfer(engine.name)
    tokenizer = registry.tokenizer
    text = "Seven bright kites drift above quiet green hills, chasing warm winds."
    prompt = tokenizer.encode("Say it back: " + text)
    assert prompt_repetition_score(prompt) < SpecConfig().prompt_gate_threshold
    script = tokenizer.encode(text)
    request = GenerationRequest("r", tuple(prompt), len(script), SamplingParams(temperature=0))
    seq = make_sequence(request, tokenizer)
    seq.processors.append(forced_tokens_processor(len(prompt), script))
    engine.admit(seq)
    plain_tokens_before_a_draft = 0
    while engine.active is not None:
        for output in engine.step().outputs:
            if len(output.token_ids) > 1:
                break
            plain_tokens_before_a_draft += len(output.token_ids)
        else:
            continue
        break
    assert seq.spec.gate_trips.get("prompt") == 1
    # (a weak first match postpones the look by 4 tokens; the old back-off waited 16)
    assert plain_tokens_before_a_draft <= 8, plain_tokens_before_a_draft
