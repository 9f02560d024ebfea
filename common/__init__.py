"""What router and shard share: process plumbing, the command line, and where a model comes from."""
