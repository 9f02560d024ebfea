"""A shard: one tensor-parallel rank of one pipeline stage. Owns tensors, never page bookkeeping."""
