"""`shardline generate`: a streaming client that prints text as it arrives."""

from __future__ import annotations

import sys

import grpc

from shardline.common.tls import client_credentials
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc


def generate(args) -> int:
    req = pb.GenerateRequest(max_new_tokens=args.max_new_tokens, stop=args.stop)
    if args.raw:
        req.prompt = args.prompt
    else:
        req.messages.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    req.sampling.temperature = args.temperature
    req.sampling.top_k = args.top_k
    if args.top_p is not None:
        req.sampling.top_p = args.top_p
    if args.seed is not None:
        req.sampling.seed = args.seed
    credentials = client_credentials(args)
    channel = grpc.secure_channel(args.target, credentials) if credentials else grpc.insecure_channel(args.target)
    with channel:
        try:
            # wait_for_ready: a server that is still starting is waited for, up to --wait seconds.
            metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
            stream = pb_grpc.GenerationStub(channel).Generate(
                req, wait_for_ready=args.wait > 0, timeout=args.wait + 600, metadata=metadata
            )
            for msg in stream:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    u = msg.usage
                    print(
                        f"\n[{msg.finish_reason}: {u.prompt_tokens} prompt tokens, {u.completion_tokens} generated]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
