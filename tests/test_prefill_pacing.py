"""The prefill pacer sizes chunks beside decoding rows by time (engines/prefill_pacing)."""

from __future__ import annotations

from engines.prefill_pacing import FLOOR, GAP_STEPS, LONE_FLOOR, LONE_SECONDS, PrefillPacer


def test_a_lone_prompt_takes_chunks_of_a_few_seconds_within_the_ceiling() -> None:
    pacer = PrefillPacer(ceiling=2048)
    assert pacer.next_chunk(decoding=False) == 512
    assert pacer.next_chunk(decoding=True) == 64
    for _ in range(6):  # a slow machine: 10 ms a token
        tokens = pacer.next_chunk(decoding=False)
        pacer.observe(tokens, 0.01 * tokens, packed=False, decoding=False)
    assert pacer.next_chunk(decoding=False) == round(LONE_SECONDS / 0.01)
    assert pacer.next_chunk(decoding=True) == 64  # the other kind of chunk is its own
    for _ in range(6):  # a fast one: the configured chunk
        tokens = pacer.next_chunk(decoding=False)
        pacer.observe(tokens, 0.0001 * tokens, packed=False, decoding=False)
    assert pacer.next_chunk(decoding=False) == 2048
    pacer.observe(4000, 1e6, packed=False, decoding=False)
    assert pacer.next_chunk(decoding=False) == LONE_FLOOR


def test_chunks_converge_to_the_gap_budget() -> None:
    """A machine where a chunk costs 50 ms plus 20 ms a token and a decode step 0.3 s:
    the chunk settles where it takes GAP_STEPS decode steps (packed) or one less."""
    for packed in (True, False):
        pacer = PrefillPacer(ceiling=2048)
        for _ in range(5):
            pacer.observe_decode(0.3)
        for _ in range(12):
            tokens = pacer.next_chunk(decoding=True)
            pacer.observe(tokens, 0.05 + 0.02 * tokens, packed)
        took = 0.05 + 0.02 * pacer.next_chunk(decoding=True)
        budget = (GAP_STEPS if packed else GAP_STEPS - 1) * 0.3
        assert 0.8 * budget <= took <= 1.05 * budget, (packed, took, budget)


def test_growth_is_bounded_and_the_floor_holds() -> None:
    pacer = PrefillPacer(ceiling=4096)
    pacer.observe(64, 0.5, packed=True)  # no decode step measured yet: unchanged
    assert pacer.next_chunk(decoding=True) == 64
    pacer.observe_decode(1.0)
    pacer.observe(64, 0.001, packed=True)  # far under budget: at most double
    assert pacer.next_chunk(decoding=True) == 128
    pacer.observe_decode(0.01)
    pacer.observe_decode(0.01)
    pacer.observe(128, 100.0, packed=True)  # far over: down to the floor
    assert pacer.next_chunk(decoding=True) == FLOOR


def test_the_decode_estimate_follows_the_machine() -> None:
    pacer = PrefillPacer(ceiling=512)
    pacer.observe_decode(0.2)
    for _ in range(20):
        pacer.observe_decode(0.4)
    assert abs(pacer.decode_seconds - 0.4) < 0.01
