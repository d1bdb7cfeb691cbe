# syntax=docker/dockerfile:1
# shardflow's image: `docker build -t shardflow:0.1.0 .` (or podman). The base is any Debian-like
# image with Python 3.11+ and its venv module; override it with --build-arg BASE=...
ARG BASE=python:3.11-slim

# Stage 1: build shardflow's wheel and collect the wheels of its dependencies.
FROM ${BASE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/build
COPY . /src
RUN /opt/build/bin/pip wheel --wheel-dir /wheels /src

# Stage 2: a venv installed from those wheels only (no index), owned by root and run by 10001.
FROM ${BASE}
# Nothing is written at run time outside /tmp (no bytecode, HOME there): the root filesystem
# may be read-only.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    PATH=/opt/shardflow/bin:$PATH
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m venv /opt/shardflow \
    && /opt/shardflow/bin/pip install --no-index --find-links /wheels shardflow \
    && echo "shardflow:x:10001:10001:shardflow:/tmp:/usr/sbin/nologin" >> /etc/passwd \
    && echo "shardflow:x:10001:" >> /etc/group
# `--app` modules are imported from the working directory too (besides installed packages).
WORKDIR /app
USER 10001:10001
ENTRYPOINT ["shardflow"]
CMD ["--help"]
