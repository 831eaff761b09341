# minivllm service image (CPU). For a GPU image build FROM an nvidia/cuda runtime base and
# install a CUDA torch build instead (see README, "GPU").
FROM python:3.11-slim

# g++: the CPU paged-attention kernel is compiled on first start for the host's CPU (-march=native).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 \
    MINIVLLM_CACHE=/cache \
    PYTHONUNBUFFERED=1

# CPU build of torch from PyTorch's CPU wheel index (keeps the image free of CUDA libraries).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY engine ./engine
COPY service ./service
COPY bench ./bench
COPY minivllm ./minivllm
# Editable: the gRPC code is generated from protos/ next to the package on first import.
RUN pip install -e . \
 && python -c "import service.pb.inference_pb2"

# Fetch and convert the default model at build time, so a container starts in seconds.
RUN python -c "from engine import resolve_model; resolve_model(None)"

EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD python -c "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
sys.exit(0 if g.HealthStub(grpc.insecure_channel('localhost:50051')).Check(h.HealthCheckRequest(), timeout=3).status == 1 else 1)"
STOPSIGNAL SIGTERM
ENTRYPOINT ["minivllm"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400"]
