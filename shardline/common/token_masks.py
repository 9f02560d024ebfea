"""Constrained decoding's token mask as a step plan carries it (shard.proto,
`SequenceStep.allowed_tokens`): one bit per token, token t at bit t % 8 of byte t / 8, in whole
32-bit words as llguidance writes them. The router makes masks, the sampling shard applies them;
this is their one shared fact."""


def mask_bytes(vocab_size: int) -> int:
    """The size of one sequence's mask for a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // 32) * 4
