"""The gateway: one address in front of many replicas (routers with their shard groups), each
request sent to the replica that caches most of its prompt, from the exact cache events the
routers stream (protos/fleet.proto). Imports common and protos only, like the router."""
