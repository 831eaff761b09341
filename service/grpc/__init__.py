"""The gRPC front doors: minivllm's own API (minivllm.v1) and vLLM's engine contract (behind the SMG gateway)."""
