"""One request never takes the others down: poisoned requests among concurrent streams of a real
server, and the server afterwards."""

import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from shardline.protos import generation_pb2 as pb
from tests.support import ROOT, Server, assert_greedy_match, hf_greedy, hf_model

pytestmark = pytest.mark.processes  # every test here starts processes

POISON_SEED = 666
FAULTS = {
    "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "faults"), os.environ.get("PYTHONPATH", "")]),
    "SHARDLINE_TEST_POISON_SEED": str(POISON_SEED),
}


def test_poisoned_requests_fail_alone_and_the_others_match_transformers(tiny_models):
    ref = hf_model(tiny_models["llama"])
    rng = random.Random(5)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (3, 9, 20, 33, 47, 64, 80, 120)]
    wants = [hf_greedy(ref, p, 12) for p in prompts]
    sampling = [
        pb.SamplingParams(temperature=1.0, seed=POISON_SEED),  # raises inside the shard's sampler
        pb.SamplingParams(temperature=1e-39, seed=3),  # a denormal temperature: greedy
        pb.SamplingParams(temperature=1.0, top_p=1.4e-45, seed=4),  # the tiniest top_p: greedy
    ] + [pb.SamplingParams()] * 5
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16", "--max-batch", "8", env=FAULTS)
    try:
        barrier = threading.Barrier(len(prompts))

        def run(i):
            barrier.wait()  # all eight in the same steps
            try:
                return server.generate(
                    prompt_token_ids=pb.PromptTokens(ids=prompts[i]),
                    max_new_tokens=12,
                    ignore_eos=True,
                    sampling=sampling[i],
                )
            except grpc.RpcError as e:
                return e

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, range(len(prompts))))
        poisoned = results[0]
        assert isinstance(poisoned, grpc.RpcError), poisoned
        assert poisoned.code() == grpc.StatusCode.INTERNAL
        assert "injected fault: poisoned request" in poisoned.details()
        for (tokens, _, last), (want, margins) in zip(results[1:], wants[1:]):
            assert_greedy_match(tokens, want, margins)
            assert last.finish_reason == "length"
        st = server.wait_idle()
        assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total
        assert st.requests_failed == 1 and st.serving and st.replica_failures == 0
        # ... and the server goes on serving, the poisoned prompt included.
        tokens, _, _ = server.generate(
            prompt_token_ids=pb.PromptTokens(ids=prompts[0]), max_new_tokens=12, ignore_eos=True
        )
        assert_greedy_match(tokens, *wants[0])
    finally:
        assert server.stop() == 0
