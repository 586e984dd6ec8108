# syntax=docker/dockerfile:1
#
# omni-mesh: one image for every process of a deployment — omni-cp, stage pods (omni-stage),
# API servers (omni-stage --api-only), omni-up and omni-run. There is no ENTRYPOINT and no CMD:
# the orchestrator sets the command of each service (see compose/).
#
#   docker build -t omni-mesh:dev .
#   docker run --rm omni-mesh:dev omni-cp serve --host 0.0.0.0 --port 7700 --redis-url redis://redis:6379/0
#
# Build arguments: PYTHON_VERSION (3.11), TORCH_VERSION (2.13.0, the CPU wheel), TORCH_INDEX_URL
# (the PyTorch CPU index; point it at a CUDA index for GPU images).

ARG PYTHON_VERSION=3.11

# ---- build: the omni-mesh wheel only (no compiler needed, the package is pure Python) ----------
FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY omni_mesh ./omni_mesh
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- runtime -------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS runtime
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

LABEL org.opencontainers.image.title="omni-mesh" \
      org.opencontainers.image.description="Serving fabric for multi-stage model pipelines: omni-cp, omni-stage, omni-up, omni-run" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in a layer of its own: it is by far the largest and changes least. The CPU
# index gives the CPU build (PyPI's default wheel pulls several GB of CUDA libraries).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The package, plus the OTLP/HTTP span exporter so that `--tracing otlp` works in the image.
COPY --from=build /wheels /tmp/wheels
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" /tmp/wheels/*.whl \
        opentelemetry-exporter-otlp-proto-http \
 && rm -rf /tmp/wheels \
 && python -c "import omni_mesh, torch, opentelemetry.exporter.otlp.proto.http.trace_exporter" \
 && omni-cp --help >/dev/null && omni-stage --help >/dev/null

# An unprivileged user with a fixed numeric id (so `runAsNonRoot` can check it).
RUN groupadd --system --gid 10001 omni \
 && useradd --system --uid 10001 --gid omni --home-dir /home/omni --create-home \
        --shell /usr/sbin/nologin omni
USER 10001:10001
WORKDIR /home/omni

# omni-cp 7700, API servers 8000, stage pods 9000 (the ports used in compose/; all configurable).
EXPOSE 7700 8000 9000
