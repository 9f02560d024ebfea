"""oneDNN linears: the same fp32 results as nn.Linear, hooks kept, tied weights left alone."""

import torch
from torch import nn

from shardline.kernels.linear import OneDnnLinear
from shardline.shard.transforms import use_onednn


def test_onednn_linear_computes_what_nn_linear_computes():
    torch.manual_seed(0)
    for bias in (False, True):
        dense = nn.Linear(64, 96, bias=bias)
        fast = OneDnnLinear(dense)
        for shape in ((1, 64), (7, 64), (2, 5, 64)):
            x = torch.randn(shape)
            torch.testing.assert_close(fast(x), dense(x), rtol=1e-5, atol=1e-5)


def test_use_onednn_keeps_forward_hooks_and_skips_shared_weights():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False))
    model[2].weight = model[0].weight  # a tied LM head
    calls = []
    model[1].register_forward_hook(lambda m, i, o: calls.append(o.shape))
    assert use_onednn(model) == 1
    assert isinstance(model[1], OneDnnLinear) and type(model[2]) is nn.Linear
    model(torch.tensor([1, 2, 3]))
    assert calls == [torch.Size([3, 8])], "the hook (a TP all-reduce) must still run"


def test_a_tensor_parallel_slice_keeps_its_own_shape():
    """TP replaces a module's weight with a slice and leaves in/out_features stale."""
    dense = nn.Linear(64, 96)
    dense.weight = nn.Parameter(torch.randn(48, 64), requires_grad=False)
    dense.bias = nn.Parameter(torch.randn(48), requires_grad=False)
    x = torch.randn(3, 64)
    torch.testing.assert_close(OneDnnLinear(dense)(x), dense(x), rtol=1e-5, atol=1e-5)
