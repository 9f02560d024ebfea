"""Test-only fault injection, loaded by Python at start-up when tests put this folder on
PYTHONPATH: with SHARDLINE_TEST_POISON_SEED set, sampling raises inside the shard for any
request with that seed, so a test can make one request fail where a real bug would.
Product code knows nothing of this."""
import os
import sys

_POISON = os.environ.get("SHARDLINE_TEST_POISON_SEED")

if _POISON:
    import importlib.abc
    import importlib.util

    class _PoisonSampler(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "shard.sampler":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_poison(module):
                exec_module(module)
                real = module.sample_row

                def sample_row(logits, params, position):
                    if params.seed == int(_POISON):
                        raise RuntimeError("injected fault: poisoned request")
                    return real(logits, params, position)

                module.sample_row = sample_row

            spec.loader.exec_module = exec_and_poison
            return spec

    sys.meta_path.insert(0, _PoisonSampler())
