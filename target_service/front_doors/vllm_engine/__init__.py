"""vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine), served on the target's gRPC port."""
