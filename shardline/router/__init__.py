"""The router: tokenizer, request lifecycle, page pool, scheduler and shard fan-out. No torch here."""
