"""Incremental detokenization and stop strings."""
from hypothesis import given, strategies as st

from router.tokenizer import Detokenizer, StopMatcher
from tests.support import smollm2_tokenizer

TOK = smollm2_tokenizer()


def test_detokenizer_streams_the_same_text_as_one_decode():
    text = "Grüße aus Köln 🚀🚀 — naïve café, 東京タワー!\n  indented"
    ids = TOK.encode(text, add_special_tokens=False)
    detok = Detokenizer(TOK)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == TOK.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)  # half a UTF-8 character is never sent


def _stream(stops, pieces):
    m, out, stopped = StopMatcher(stops), "", False
    for p in pieces:
        sent, stopped = m.feed(p)
        out += sent
        if stopped:
            return out, True
    return out + m.flush(), False


def test_stop_string_split_across_deltas_is_never_sent():
    out, stopped = _stream(["###"], ["Hello #", "#", "# world"])
    assert (out, stopped) == ("Hello ", True)
    out, stopped = _stream(["###"], ["a #", "# b"])
    assert (out, stopped) == ("a ## b", False)


@given(st.text(alphabet="ab#\n", max_size=40), st.lists(st.integers(1, 5), max_size=20),
       st.sampled_from([["#"], ["##"], ["ab#", "\n\n"], ["b"]]))
def test_stop_matching_equals_cutting_at_the_first_match(text, cuts, stops):
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i:i + c])
        i += c
    pieces.append(text[i:])
    hits = [text.find(s) for s in stops if s in text]
    want = text[:min(hits)] if hits else text
    out, stopped = _stream(stops, pieces)
    assert out == want and stopped == bool(hits)
