"""Speculative decoding in the real server (SmolLM2, dequantized weights): text that copies from
its prompt is proposed and verified several tokens a step, and the output is what decoding a
token a step gives (and transformers), with logprobs, stop strings, limits, seeds, cancellation
and both APIs. Chunking, the prefix cache and TP2 with speculation: tests/test_chunked_serving.py
and tests/test_parallel.py; PP2: the tiny layouts there."""

import grpc
import openai
import pytest

from shardline.protos import generation_pb2 as pb
from tests.support import assert_greedy_match, hf_greedy, smollm2_hf_model, smollm2_tokenizer

pytestmark = [pytest.mark.processes, pytest.mark.smollm2]

PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass "
    "lantern and a notebook in which he wrote the colour of the sea, the direction of the wind "
    "and the names of the ships that passed the rocky point."
)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def copying():
    """A prompt whose answer copies it, and transformers' greedy tokens."""
    ids = smollm2_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"Repeat this sentence word for word:\n\n{PARAGRAPH}"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    return list(ids), hf_greedy(smollm2_hf_model(), list(ids), NEW_TOKENS)


def _spec(server) -> tuple[int, int, int]:
    st = server.stats()
    return st.spec_verifications, st.spec_proposed_tokens, st.spec_accepted_tokens


def _generate(server, ids, **kwargs):
    return server.generate(prompt_token_ids=pb.PromptTokens(ids=ids), ignore_eos=True, **kwargs)


def test_copied_text_is_verified_several_tokens_a_step_and_matches_transformers(smollm2_server, copying):
    ids, (want, margins) = copying
    before = _spec(smollm2_server)
    got, _, last = _generate(smollm2_server, ids, max_new_tokens=NEW_TOKENS, logprobs=2)
    verifications, proposed, accepted = (a - b for a, b in zip(_spec(smollm2_server), before))
    assert_greedy_match(got, want, margins)
    assert last.usage.completion_tokens == NEW_TOKENS
    # What was proposed (copied from the prompt) was accepted. How much was proposed is not
    # asked: the policy proposes by the step times it measures, so that is the machine's load's
    # (a loaded CI machine proposed a third of what a quiet one does).
    assert verifications > 0 and accepted >= 0.75 * proposed, (verifications, proposed, accepted)
    # Opted out: a token a step, the same tokens, the same log-probabilities (the target's).
    before = _spec(smollm2_server)
    plain, _, _ = _generate(smollm2_server, ids, max_new_tokens=NEW_TOKENS, logprobs=2, speculative=False)
    assert _spec(smollm2_server) == before and plain == got
    with_lp = [r for r in smollm2_server.stub.Generate(_request(ids, logprobs=2))]
    without = [r for r in smollm2_server.stub.Generate(_request(ids, logprobs=2, speculative=False))]
    lp, lp_plain = ([t for r in replies for t in r.logprobs] for replies in (with_lp, without))
    assert len(lp) == len(lp_plain) == NEW_TOKENS
    for a, b in zip(lp, lp_plain):
        assert a.token_id == b.token_id and [x.token_id for x in a.top] == [x.token_id for x in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)


def _request(ids, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=NEW_TOKENS, ignore_eos=True, **kwargs
    )


def test_limits_stop_strings_and_seeds_hold_with_several_tokens_a_step(smollm2_server, copying):
    ids, (want, _) = copying
    for limit in (1, 2, 5, 13):  # never past max_new_tokens, whatever was accepted
        got, _, last = _generate(smollm2_server, ids, max_new_tokens=limit)
        assert got == want[:limit] and last.finish_reason == "length"
    # A stop string inside the copied text: the output ends before it, however many tokens the
    # step that reached it accepted.
    _, text, last = _generate(smollm2_server, ids, max_new_tokens=NEW_TOKENS, stop=["brass"])
    assert last.finish_reason == "stop" and text.endswith("carrying a ") and "brass" not in text
    # Sampled: the same seed, the same tokens, with speculation or without (a proposal is
    # accepted where it equals the target's own draw at its position).
    sampling = pb.SamplingParams(temperature=0.5, top_k=40, seed=11)
    before = _spec(smollm2_server)
    first, _, _ = _generate(smollm2_server, ids, max_new_tokens=NEW_TOKENS, sampling=sampling)
    assert _spec(smollm2_server)[2] > before[2]
    again, _, _ = _generate(smollm2_server, ids, max_new_tokens=NEW_TOKENS, sampling=sampling, speculative=False)
    assert first == again and len(first) == NEW_TOKENS


def test_cancelling_while_proposals_are_verified_returns_every_page(smollm2_server, copying):
    ids, _ = copying
    before = _spec(smollm2_server)
    for after in (1, 2, 3, 5, 8):  # responses read before the cancel: different steps
        call = smollm2_server.stub.Generate(_request(ids, request_id=f"cancel-{after}"))
        for _ in range(after):
            next(call)
        smollm2_server.stub.Cancel(pb.CancelRequest(request_id=f"cancel-{after}"))
        replies = list(call)
        assert replies[-1].finish_reason in ("cancelled", "length")
    call = smollm2_server.stub.Generate(_request(ids))
    next(call)
    call.cancel()  # the client goes away mid-stream
    with pytest.raises(grpc.RpcError):
        list(call)
    st = smollm2_server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_reserved == 0
    assert st.pages_free + st.pages_evictable == st.pages_total
    assert _spec(smollm2_server)[0] > before[0]


def test_the_openai_api_takes_the_opt_out_and_answers_the_same(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.http_url, api_key="unused", max_retries=0, timeout=120)
    model = smollm2_server.stub.Info(pb.InfoRequest()).model
    messages = [{"role": "user", "content": f"Repeat this sentence word for word:\n\n{PARAGRAPH}"}]
    answers = [
        client.chat.completions.create(model=model, messages=messages, max_tokens=30, temperature=0, extra_body=extra)
        for extra in ({}, {"speculative": False})
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.completion_tokens == 30
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=3, extra_body={"speculative": "sometimes"}
        )


def test_a_constrained_answer_is_proposed_within_its_constraint_and_masked_per_row(smollm2_server, copying):
    """The copied sentence under a regex that its characters satisfy: proposals cut to what the
    constraint accepts, each row masked, the tokens those of decoding a token a step."""
    ids, _ = copying
    regex = "[A-Za-z ,.]{1,400}"
    before = _spec(smollm2_server)
    got, text, _ = _generate(smollm2_server, ids, max_new_tokens=NEW_TOKENS, regex=regex)
    verifications, proposed, accepted = (a - b for a, b in zip(_spec(smollm2_server), before))
    # the copied sentence's proposals, cut to what the regex accepts, accepted (how many are sent
    # is the measured step times', so the load's: see the test above)
    assert verifications > 0 and accepted >= 0.75 * proposed, (verifications, proposed, accepted)
    plain, plain_text, _ = _generate(smollm2_server, ids, max_new_tokens=NEW_TOKENS, regex=regex, speculative=False)
    assert (
        got == plain
        and text == plain_text
        and set(text) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,.")
    )
    # A constraint that forbids what the prompt would propose: nothing it refuses is emitted.
    got, text, _ = _generate(smollm2_server, ids, max_new_tokens=12, regex="[a-z ]{1,60}")
    assert set(text) <= set("abcdefghijklmnopqrstuvwxyz ")


@pytest.fixture(scope="module")
def suffix_server():
    """Suffix decoding beside prompt lookup, on the GGUF's quantized kernels as served by default."""
    from tests.support import Server

    server = Server("--speculative", "suffix")
    yield server
    assert server.stop() == 0, "".join(server.log[-30:])


def test_suffix_decoding_proposes_an_earlier_answer_and_the_text_stays_greedy(suffix_server):
    """An answer that copies nothing from its prompt: the first time a token a step, nearly; asked
    again, the first answer's tokens are proposed and accepted, and every run's tokens are those
    of decoding a token a step (on int8 activations, so bit for bit: test_row_invariance.py)."""
    ids = smollm2_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Write a short story about a dragon who learns to bake bread."}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    plain, _, _ = _generate(suffix_server, list(ids), max_new_tokens=NEW_TOKENS, speculative=False)
    before = _spec(suffix_server)
    first, _, _ = _generate(suffix_server, list(ids), max_new_tokens=NEW_TOKENS)
    middle = _spec(suffix_server)
    again, _, _ = _generate(suffix_server, list(ids), max_new_tokens=NEW_TOKENS)
    after = _spec(suffix_server)
    assert first == plain and again == plain
    first_accepted, again_accepted = middle[2] - before[2], after[2] - middle[2]
    again_proposed = after[1] - middle[1]
    assert first_accepted < NEW_TOKENS // 2, first_accepted
    # What was proposed was the earlier answer, so it was accepted. How much was proposed, and in
    # how many steps, is not asked: the policy proposes by the step times it measures, so that is
    # the machine's load's (a sequence's first proposal of each kind is always sent).
    assert again_proposed > 0 and again_accepted >= 0.9 * again_proposed, (again_proposed, again_accepted)
