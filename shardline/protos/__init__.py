"""The gRPC contracts. `*_pb2*.py` are generated from the `.proto` files at install time."""
