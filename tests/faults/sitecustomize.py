"""Test-only fault injection, loaded by Python at start-up when tests put this folder on
PYTHONPATH: with SHARDLINE_TEST_POISON_SEED set, sampling raises inside the shard for any
request with that seed, so a test can make one request fail where a real bug would; with
SHARDLINE_TEST_HANG_SEED (and SHARDLINE_TEST_HANG_S), sampling for that seed blocks the shard's
compute for that long while its gRPC threads go on answering, as a deadlock would.
Product code knows nothing of this."""

import os
import sys
import time

_POISON = os.environ.get("SHARDLINE_TEST_POISON_SEED")
_HANG = os.environ.get("SHARDLINE_TEST_HANG_SEED")

if _POISON or _HANG:
    import importlib.abc
    import importlib.util

    class _PoisonSampler(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "shardline.shard.sampler":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_poison(module):
                exec_module(module)
                real = module.sample_row

                def sample_row(logits, params, position):
                    if _POISON and params.seed == int(_POISON):
                        raise RuntimeError("injected fault: poisoned request")
                    if _HANG and params.seed == int(_HANG):
                        time.sleep(float(os.environ.get("SHARDLINE_TEST_HANG_S", "10")))
                    return real(logits, params, position)

                module.sample_row = sample_row

            spec.loader.exec_module = exec_and_poison
            return spec

    sys.meta_path.insert(0, _PoisonSampler())
