# minivllm service image (CPU). For a GPU image build FROM an nvidia/cuda runtime base and
# install a CUDA torch build instead (see README, "GPU").
#
# Layers go from what changes least to what changes most, so a code edit rebuilds only the last
# two: system packages, torch, the other dependencies (from pyproject.toml alone), the default
# model (fetched and converted by the loader module alone), then the source.
FROM python:3.11-slim

# g++: the C++ kernels are compiled when the image is built (`pip install .` below; portable, their
# SIMD path chosen at run time), and on first start only under another torch.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin minivllm

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 \
    MINIVLLM_CACHE=/cache \
    PYTHONUNBUFFERED=1

# CPU build of torch from PyTorch's CPU wheel index (keeps the image free of CUDA libraries).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The runtime dependencies, read from pyproject.toml: a source edit does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

# The default model, fetched and converted once, in a layer that only the loader's code invalidates
# (weights/checkpoint.py needs only engine/config.py; without __init__.py files the two load as a
# namespace package, so nothing else of the source is needed yet).
COPY engine/config.py /tmp/loader/engine/config.py
COPY engine/execution/weights/checkpoint.py /tmp/loader/engine/execution/weights/checkpoint.py
RUN PYTHONPATH=/tmp/loader python -c "from engine.execution.weights.checkpoint import resolve_model; resolve_model(None)" \
 && mkdir -p /cache/torch_extensions \
 && chown -R minivllm:minivllm /cache \
 && rm -rf /tmp/loader

# The source, built as a regular (non-editable) install: the gRPC code is generated and the C++
# kernels compiled by the build, whose torch==2.13.0 ([build-system] requires) comes from the CPU index
# too (2.13.0+cpu, the same build as above: the compiled kernels are used only under their own torch).
COPY setup.py README.md ./
COPY protos ./protos
COPY engine ./engine
COPY service ./service
COPY bench ./bench
COPY minivllm ./minivllm
RUN pip install --no-deps --extra-index-url https://download.pytorch.org/whl/cpu . \
 && rm -rf build *.egg-info

USER minivllm
# gRPC, OpenAI-compatible HTTP, Prometheus metrics. Torch threads follow the CPUs the container
# may use (affinity and cgroup quota), so `cpus: 2` in compose means two threads.
EXPOSE 50051 8000 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
  CMD python -c "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
sys.exit(0 if g.HealthStub(grpc.insecure_channel('localhost:50051')).Check(h.HealthCheckRequest(), timeout=3).status == 1 else 1)"
STOPSIGNAL SIGTERM
ENTRYPOINT ["minivllm"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", "--metrics-port", "9400"]
