"""Our GGUF conversion equals transformers' own GGUF loader, tensor for tensor."""

import numpy as np
import pytest
import torch

from shardline.common.model_source import resolve_model
from shardline.shard.weights import load_state_dict, unpermute_rope


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert_hf_to_gguf.py permutes rows this way before writing Q and K.
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope(permuted, heads), w)


@pytest.mark.smollm2
def test_smollm2_weights_equal_transformers_gguf_loader():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = resolve_model(None)
    cfg, ours = load_state_dict(source)
    # The skeleton only names the tensors; transformers reads the heads it unpermutes by from the
    # file's own config, which it returns, so the file is parsed once (each parse takes seconds).
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads,
                tie_word_embeddings=cfg.tie_word_embeddings,
            )
        )
    parsed = load_gguf_checkpoint(str(source.path), return_tensors=True, model_to_load=skeleton)
    theirs, hf_config = parsed["tensors"], parsed["config"]
    assert set(theirs) == set(ours)
    for name, tensor in theirs.items():
        assert torch.equal(torch.as_tensor(tensor).float(), ours[name]), name
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size, cfg.intermediate_size) == (
        hf_config["num_hidden_layers"],
        hf_config["num_attention_heads"],
        hf_config["num_key_value_heads"],
        hf_config["hidden_size"],
        hf_config["intermediate_size"],
    )
    assert cfg.tie_word_embeddings
