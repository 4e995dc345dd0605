"""What a prefix-cache entry keeps of a drafter fed the target's hidden states.

DFlash's context K/V at position i depends on tokens <= i; an EAGLE-3 chain's entry i
is the pair (target states at i, token i + 1), so it depends on one token more
(`ahead`). An entry keeps the drafter's cache beside the target's with the tokens it
depends on (`DraftState.fed`), and the prefix cache cuts both to the tokens they share
with the next prompt. A request starting from it drafts with the prompt's context at
once instead of restarting its drafter at the hit (drafts weaker until the drafter
has seen enough again). The MTP head keeps nothing here (its entries would need an
identity of their own on disk); Gemma-4's assistant needs nothing (it reads the
target's own cache and its newest state, which the hit's prefill gives).

Every call runs on the engine thread.
"""

from __future__ import annotations

from engines.cache.ragged_cache import RaggedKVCache
from engines.drafting.draft_model import DraftState
from engines.drafting.mtp import MTPState
from engines.request import common_prefix


def drafter_entry(
    state: MTPState | None, tokens: list[int], layers: list, ahead: int
) -> DraftState | None:
    """The entry of a drafter whose `layers` (one sequence's cache, copied by the caller)
    hold `state.length` positions from 0: those layers and the tokens they depend on.
    None when the state did not start at 0 (it restarted after positions it never saw)."""
    if state is None or state.start != 0 or not state.length or not layers:
        return None
    fed = list(tokens[: state.length + ahead])
    if len(fed) < state.length + ahead:
        return None
    return DraftState(layers, fed)


def state_from_entry(draft: DraftState | None, tokens: list[int], ahead: int) -> MTPState | None:
    """The drafter state a request with `tokens` starts on from an entry: the positions
    whose tokens it shares (its cache is cut to them), or None when it shares none."""
    if draft is None or not draft.cache:
        return None
    cache = [RaggedKVCache.from_caches([layer]) for layer in draft.cache]
    held = cache[0].lengths[0]
    usable = min(held, common_prefix(draft.fed, tokens) - ahead)
    if usable <= 0:
        return None
    if usable < held:
        for layer in cache:
            layer.set_lengths([usable])
    return MTPState(cache=cache, start=0, length=usable)
