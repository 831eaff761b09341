"""minivllm service: gRPC transport and observability around the engine.

Imports only engine's public API; the engine reports through plain dataclasses.
"""
