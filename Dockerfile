# The coordinator's image: `docker build -t spark-eos-coordinator .`
# Stage 1 builds the project's wheel and installs it into a venv with the service's dependencies: the
# [server] extra alone (deploy/docker/requirements_of.py), not the writer's; stage 2 copies only that
# venv onto a slim Python. Runs as a non-root uid and writes nothing outside /tmp,
# so it runs with a read-only root filesystem (Kubernetes readOnlyRootFilesystem, compose read_only).
# PYTHON_IMAGE: the official python image by default; `python -m localimages` builds it on a Debian
# base it made itself. Python packages come from PyPI, or only from deploy/image-inputs/wheels/ when
# that holds wheels (built on the host by `python -m localimages`: nothing downloaded in the build).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY deploy/image-inputs/ /image-inputs/
COPY pyproject.toml README.md ./
COPY coordinator ./coordinator
COPY migrations ./migrations
COPY deploy/docker/requirements_of.py /tmp/
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN if ls /image-inputs/wheels/*.whl > /dev/null 2>&1; then \
      export PIP_NO_INDEX=1 PIP_FIND_LINKS=/image-inputs/wheels; fi \
 && pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/venv \
 && WHEEL=$(ls /wheels/*.whl) \
 && /opt/venv/bin/pip install --no-deps "${WHEEL}" \
 && /opt/venv/bin/python /tmp/requirements_of.py spark-kafka-exactly-once server > /tmp/server-requirements.txt \
 && /opt/venv/bin/pip install -r /tmp/server-requirements.txt \
 && /opt/venv/bin/python -m compileall -q /opt/venv/lib

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    COORDINATOR_HOST=0.0.0.0 \
    COORDINATOR_PORT=8000 \
    COORDINATOR_DATA_DIR=/tmp/coordinator-data
RUN groupadd --gid 10001 coordinator \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin coordinator
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
# slim has no curl: the liveness check is Python's urllib against /healthz on the configured port
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('COORDINATOR_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["coordinator"]
# `coordinator migrate` is the same image with another command (the compose `migrate` service,
# the Kubernetes migration Job)
CMD ["serve"]
