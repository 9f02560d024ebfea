"""The engine core: sequences, scheduler, KV manager, page pool, step loop and shard group. It
knows the shard contract (shard.proto) and nothing of the public APIs that feed it."""
