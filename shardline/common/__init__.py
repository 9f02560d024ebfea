"""What router, shard and gateway share: process plumbing, where a model comes from, its
tokenizer and prompt page hashes, API keys, TLS."""
