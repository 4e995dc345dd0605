"""Text stop sequences: matched across token boundaries, never leaked to the client."""

from engines.sample.stopping import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for piece in pieces:
        text, matched = matcher.feed(piece)
        out.append(text)
        if matched:
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


def test_stop_split_across_pieces_is_cut_before_the_stop():
    assert feed_all(StopMatcher(("END",)), ["hello E", "N", "D more"]) == ("hello ", "END")


def test_partial_stop_prefix_is_held_back_then_released():
    matcher = StopMatcher(("END",))
    assert matcher.feed("abc EN") == ("abc ", None)
    assert matcher.feed("x") == ("ENx", None)


def test_earliest_of_several_stops_wins():
    assert feed_all(StopMatcher(("world", "lo w")), ["hello world"]) == ("hel", "lo w")


def test_unmatched_held_text_is_flushed_at_the_end():
    assert feed_all(StopMatcher(("STOP",)), ["the end ST"]) == ("the end ST", None)


def test_no_stops_passes_text_through():
    assert StopMatcher(()).feed("anything") == ("anything", None)
