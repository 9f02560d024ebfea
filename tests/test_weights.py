"""Our GGUF conversion equals transformers' own GGUF loader, tensor for tensor."""
import numpy as np
import pytest
import torch

from common.model_source import resolve_model
from shard.weights import load_state_dict, unpermute_rope


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert_hf_to_gguf.py permutes rows this way before writing Q and K.
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope(permuted, heads), w)


@pytest.mark.smollm2
def test_smollm2_weights_equal_transformers_gguf_loader():
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = resolve_model(None)
    cfg, ours = load_state_dict(source)
    hf_config = AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(hf_config)
    theirs = load_gguf_checkpoint(str(source.path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(theirs) == set(ours)
    for name, tensor in theirs.items():
        assert torch.equal(torch.as_tensor(tensor).float(), ours[name]), name
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        hf_config.num_hidden_layers, hf_config.num_attention_heads, hf_config.num_key_value_heads)
    assert cfg.tie_word_embeddings
