# One image for every epdmesh process (toggle, workers, gateway, make-tiny-model); docker-compose.yml
# picks the process with its command. CPU only: torch comes from the PyTorch CPU index.
#
#   docker build -t epdmesh:local .
#   docker run --rm epdmesh:local epdmesh --help
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /opt/epdmesh

# 0. A C/C++ compiler: serve compiles the model's dense path with inductor on the CPU and builds the C decode
#    attention (kernels/cpu_paged.c) at start-up (without one, serve needs --enforce-eager).
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# 1. torch first, from the CPU index: an unpinned torch from PyPI pulls a multi-GB CUDA build.
#    Keep the pin equal to pyproject.toml's (tests/test_compose.py checks it); 2.13.0+cpu satisfies torch==2.13.0.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# 2. The other dependencies, from pyproject.toml alone, so that a source change does not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# 3. The package itself (dependencies are already satisfied, torch stays the CPU build).
COPY common ./common
COPY epdmesh ./epdmesh
COPY kernels ./kernels
COPY services ./services
RUN pip install . && rm -rf build ./*.egg-info

# 4. A non-root user. /models belongs to it, so a named volume mounted there starts out writable
#    (Docker copies the image directory's ownership into an empty named volume).
RUN groupadd --system --gid 10001 epdmesh \
    && useradd --system --uid 10001 --gid epdmesh --create-home --home-dir /home/epdmesh epdmesh \
    && mkdir -p /models \
    && chown epdmesh:epdmesh /models
USER epdmesh
WORKDIR /home/epdmesh

# Health probes (see docker-compose.yml): no grpc_health_probe download; the toggle and the workers are
# probed with a python one-liner over grpc_health.v1 (grpcio-health-checking is a dependency), e.g.
#   python -c "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
#     sys.exit(g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(h.HealthCheckRequest(), timeout=3).status \
#     != h.HealthCheckResponse.SERVING)" 127.0.0.1:50061
# and the gateway with urllib on GET /health.
EXPOSE 8000 50051 50061
CMD ["epdmesh", "--help"]
