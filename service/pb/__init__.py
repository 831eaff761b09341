"""Generated gRPC modules (inference_pb2, inference_pb2_grpc), written by the build from
protos/inference.proto (setup.py); `pip install -e .` regenerates them after a .proto edit."""
