"""Shardline: a router/shard inference server for Llama-family language models.

Everything installs under this one name. The parts are its subpackages (DESIGN.md, "Layers"):
`router`, `shard` and `gateway` (the three services), `kernels` (leaves that know tensors),
`common` (what the services share) and `protos` (the contracts). The package's own modules are
the composition on top: the `shardline` command (`cli.py`), the launchers of `shardline serve`,
child processes, the streaming client, local certificates.
"""
