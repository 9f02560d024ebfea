"""The shard group on the wire: its gRPC streams (group.py), the codec between the core's steps
and shard.proto (codec.py), and the two composed as the core's `Shards` (link.py)."""
