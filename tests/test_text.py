"""Tokenizer, chat template and streamed text of the router, against `transformers`; stop strings."""

import json
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardline.common.tokenizer import TemplateError, TextCodec
from shardline.router.core.stop_strings import StopMatcher
from tests.support import smollm2_codec, smollm2_tokenizer

TEXT = "Grüße aus Köln 🚀🚀 — naïve café, 東京タワー!\n  indented <|im_end|> \x00\x07 tab\tend"


def test_encode_equals_transformers():
    tok, codec = smollm2_tokenizer(), smollm2_codec()  # transformers: the reference; what the router runs
    assert codec.encode(TEXT) == tok.encode(TEXT, add_special_tokens=False)
    assert codec.end_token_ids == {tok.eos_token_id}
    assert codec.vocab_size == len(tok)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Name three colors."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": TEXT},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": ""},
        ],
    ],
)
def test_chat_template_renders_like_transformers(messages):
    tok, codec = smollm2_tokenizer(), smollm2_codec()
    want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert codec.encode(codec.render_chat(messages)) == list(want)


def test_template_errors_are_template_errors(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(CODEC_FOLDER(), folder)
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    codec = TextCodec(folder)
    assert codec.render_chat([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(TemplateError, match="first message must be from the user"):
        codec.render_chat([{"role": "assistant", "content": "hi"}])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").unlink()
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TemplateError, match="no chat template"):
        TextCodec(folder).render_chat([{"role": "user", "content": "hi"}])


def test_a_gguf_tokenizer_converts_to_the_files_transformers_makes_of_it(tmp_path):
    """The metadata is read by Shardline's header reader, the conversion is transformers' own: the
    files equal those of transformers' public GGUF path, which reads the file itself."""
    from transformers import PreTrainedTokenizerFast

    from shardline.common.gguf_tokenizer import convert
    from shardline.common.model_source import resolve_model

    gguf = resolve_model(None).path
    convert(gguf, tmp_path / "ours")
    PreTrainedTokenizerFast(gguf_file=gguf.name, name_or_path=str(gguf.parent)).save_pretrained(tmp_path / "theirs")
    names = sorted(f.name for f in (tmp_path / "theirs").iterdir())
    assert sorted(f.name for f in (tmp_path / "ours").iterdir()) == names
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    for name in names:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name


def CODEC_FOLDER():
    from shardline.common.model_source import resolve_model
    from shardline.common.tokenizer_files import tokenizer_folder

    return tokenizer_folder(resolve_model(None))


def test_detokenizer_streams_the_same_text_as_one_decode():
    tok, codec = smollm2_tokenizer(), smollm2_codec()
    ids = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    detok = codec.stream()
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)  # half a UTF-8 character is never sent
    assert any(d == "" for d in deltas[:-1])  # ... the emoji's first bytes were held back


def _stream(stops, pieces, matched: list | None = None):
    """(text sent, whether a stop string ended it); `matched` gets the stop string it ended at."""
    m, out = StopMatcher(stops), ""
    for p in pieces:
        sent, stopped = m.feed(p)
        out += sent
        if stopped:
            break
    else:
        sent, stopped = m.flush()
        out += sent
    if matched is not None:
        matched.append(m.matched)
    return out, stopped


def test_stop_string_split_across_deltas_is_never_sent():
    assert _stream(["###"], ["Hello #", "#", "# world"]) == ("Hello ", True)
    assert _stream(["###"], ["a #", "# b"]) == ("a ## b", False)
    # "bc" completes first, but "abcd" starts earlier and is still possible: wait for it.
    assert _stream(["abcd", "bc"], ["a", "b", "c", "d"]) == ("", True)
    assert _stream(["abcd", "bc"], ["a", "b", "c", "x"]) == ("a", True)
    assert _stream(["abcd", "bc"], ["xab", "c"]) == ("xa", True)  # ends while abcd is pending


@given(
    st.text(alphabet="ab#\n", max_size=60),
    st.lists(st.integers(1, 5), max_size=30),
    st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=6), min_size=0, max_size=4),
)
def test_stop_matching_equals_cutting_at_the_first_match(text, cuts, stops):
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i : i + c])
        i += c
    pieces.append(text[i:])
    hits = [text.find(s) for s in stops if s in text]
    want = text[: min(hits)] if hits else text
    matched = []
    assert _stream(stops, pieces, matched) == (want, bool(hits))
    if hits:  # the stop string the text ended at: one that begins where the text was cut
        assert matched[0] in stops and text[min(hits) :].startswith(matched[0])
    else:
        assert matched[0] is None


def test_stop_matcher_keeps_only_the_withheld_tail():
    """Its work per delta cannot grow with the text so far: it keeps no more than the longest
    stop string, however much text has passed."""
    stops = ["x" * 200 + str(i) for i in range(16)]
    m = StopMatcher(stops)
    for _ in range(2000):
        m.feed("x" * 50)
        assert len(m._pending) <= 200
    assert m.feed("3") == ("", True)


def test_encoding_a_long_prompt_lets_other_threads_run():
    """The router tokenizes on a worker thread; that helps the event loop only if the GIL is
    released meanwhile (tokenizers' plain `encode` holds it for the whole text)."""
    import threading
    import time

    text = "every stream keeps streaming while this is tokenized. " * 40_000  # 2 MB
    gaps, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            t = time.perf_counter()
            time.sleep(0.002)
            gaps.append(time.perf_counter() - t)

    thread = threading.Thread(target=ticker)
    thread.start()
    t0 = time.perf_counter()
    ids = smollm2_codec().encode(text)
    took = time.perf_counter() - t0
    done.set()
    thread.join()
    assert len(ids) > 300_000
    assert max(gaps) < took / 4, f"a thread waited {max(gaps):.3f} s while encoding took {took:.3f} s"
