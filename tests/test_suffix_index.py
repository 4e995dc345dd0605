"""The suffix index (`engines.drafting.suffix`): token ids standing for earlier requests
of one key, with exact expectations for matches, frequency-weighted drafts, adaptive
draft length and the token bound."""

from __future__ import annotations

import pytest

from engines.drafting.draft import SUFFIX
from engines.drafting.suffix import (
    BYTES_PER_TOKEN,
    MAX_OCCURRENCES,
    SuffixIndex,
    SuffixReader,
    gram_key,
    match_bucket,
)
from engines.gating.gates import MethodGate
from engines.gating.measured_costs import CostModel

QUESTION = [11, 12, 13, 14, 15, 16, 17, 18]
HEADER = [1, 2]  # the chat template's assistant header, the same in every request
ANSWER = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


def test_the_same_question_again_drafts_the_earlier_answer_in_full():
    index = SuffixIndex()
    index.add([7, *QUESTION, *HEADER, *ANSWER])
    index.add([8, 30, 31, 32, *HEADER, 50, 51, 52])  # another question, same header
    draft = index.propose([9, 9, *QUESTION, *HEADER], 8)
    assert draft is not None and draft.method == SUFFIX
    assert draft.tokens == ANSWER[:8]
    assert draft.match_length == 8  # QUESTION + HEADER agree: 10 tokens, bucket 8
    # its estimates: one earlier answer agreeing all along, the first discounted by how
    # far a 10-token match is to be trusted
    assert draft.confidences == pytest.approx([10 / 12] + [1.0] * 7)
    # midway through the answer the copy goes on from where the output is
    assert index.propose([9, *QUESTION, *HEADER, *ANSWER[:4]], 3).tokens == ANSWER[4:7]


def test_the_draft_is_as_long_as_the_match_allows():
    index = SuffixIndex()
    index.add([5, 6, 7, 8, 9, 10, 11, 12, 13])
    # a two-token match earns two tokens; a four-token match four
    assert index.propose([0, 0, 6, 7], 8).tokens == [8, 9]
    assert index.propose([4, 6, 7], 8).tokens == [8, 9]
    assert index.propose([5, 6, 7, 8, 9], 8).tokens == [10, 11, 12, 13]
    assert index.propose([5, 6, 7, 8, 9], 2).tokens == [10, 11]  # and at most k


def test_the_most_frequent_continuation_wins_and_a_rare_branch_stops_the_draft():
    index = SuffixIndex()
    for tail in ([20, 21, 22, 23], [20, 21, 22, 23], [20, 21, 22, 23], [20, 25, 26, 27]):
        index.add([3, 4, 5, 6, *tail])
    # [3, 4, 5, 6] matched in all four: 20 always, then 21 three times in four
    draft = index.propose([3, 4, 5, 6], 4)
    assert draft.tokens == [20, 21, 22, 23]
    assert draft.confidences == pytest.approx([4 / 6, 0.75, 1.0, 1.0])
    # a key whose suffix drafts mostly started wrong trusts its index less
    index.learn_acceptance(drafts=8, first_accepted=1)
    assert index.trust == pytest.approx(3 / 10)
    assert index.propose([3, 4, 5, 6], 4).confidences == pytest.approx([0.2, 0.75, 1.0, 1.0])
    # ten ways after the same two tokens: no continuation is likely enough to draft
    spread = SuffixIndex()
    for token in range(100, 111):
        spread.add([60, 61, token])
    assert spread.propose([60, 61], 4) is None


def test_a_longer_match_beats_a_more_frequent_shorter_one():
    index = SuffixIndex()
    for _ in range(5):
        index.add([70, 71, 1, 2, 90, 91, 92])  # frequent after [1, 2]
    index.add([80, 81, 82, 83, 1, 2, 95, 96, 97, 98])  # once, after a longer context
    assert index.propose([80, 81, 82, 83, 1, 2], 4).tokens == [95, 96, 97, 98]
    assert index.propose([0, 1, 2], 3).tokens == [90, 91]  # short match, short draft


def test_nothing_found_is_none():
    index = SuffixIndex()
    assert index.propose([1, 2, 3], 4) is None
    index.add([1, 2, 3, 4])
    assert index.propose([2, 4], 4) is None
    assert index.propose([1, 2], 0) is None
    assert index.propose([2], 4) is None


def test_the_index_holds_at_most_its_tokens_and_evicts_the_oldest_first():
    index = SuffixIndex(max_tokens=30)
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    index.add([21, 22, 23, 24, 25, 26, 27, 28, 29, 30])
    index.add([41, 42, 43, 44, 45, 46, 47, 48, 49, 50])
    assert index.stats()["tokens"] == 30
    index.add([61, 62, 63, 64, 65])
    assert index.stats() == {
        "bytes": 25 * BYTES_PER_TOKEN,
        "sequences": 3,
        "tokens": 25,
        "grams": 19,
        "evicted_sequences": 1,
    }
    assert index.propose([1, 2, 3], 4) is None  # the oldest is gone, its grams too
    assert index.propose([21, 22, 23], 2).tokens == [24, 25]
    assert gram_key([1, 2], 2) not in index.grams
    index.add(list(range(200, 260)))  # longer than the bound: only its last 30 tokens
    assert index.stats()["tokens"] == 30 and len(index.sequences) == 1
    assert index.propose([231, 232], 2).tokens == [233, 234]
    assert index.propose([228, 229], 2) is None
    assert index.propose([200, 201], 2) is None


def test_a_frequent_gram_keeps_only_its_latest_occurrences():
    index = SuffixIndex(max_tokens=1 << 20)
    for i in range(MAX_OCCURRENCES + 10):
        index.add([5, 5, 1000 + i])
    assert len(index.grams[gram_key([5, 5], 2)]) == MAX_OCCURRENCES
    # eviction of sequences whose occurrences were already dropped keeps the rest
    small = SuffixIndex(max_tokens=3 * (MAX_OCCURRENCES + 1))
    for i in range(MAX_OCCURRENCES + 10):
        small.add([5, 5, 1000 + i])
    assert len(small.sequences) == MAX_OCCURRENCES + 1
    assert len(small.grams[gram_key([5, 5], 2)]) == MAX_OCCURRENCES
    assert all(o >> 32 in small.sequences for o in small.grams[gram_key([5, 5], 2)])


def test_match_buckets_and_the_reader_only_proposes():
    assert [match_bucket(n) for n in (1, 2, 3, 4, 7, 8, 40, 64)] == [1, 2, 2, 4, 4, 8, 32, 64]
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5])
    reader = SuffixReader(index)
    assert reader.propose([1, 2, 3], 2).tokens == [4, 5]
    assert not hasattr(reader, "add")


def test_a_drafts_own_estimate_is_the_gates_prior_until_its_match_length_is_verified():
    gate = MethodGate(SUFFIX, alpha=0.5)
    assert gate.acceptance(16, [0.9, 1.0]) == (0.9, 1.0)
    assert gate.acceptance(16) == (0.5,)
    gate.record(4, 1, 16, CostModel.assumed(9), match=16)  # first accepted, second not
    # now this request's own verifies of 16-token matches rule, pulled towards the
    # pooled rates while they are few
    assert gate.acceptance(16, [0.9, 1.0]) == pytest.approx((7 / 9, 14 / 27))
    assert gate.acceptance(8, [0.9, 1.0]) == (0.9, 1.0)  # another length: still its own
