# The example Spark job and the read_committed verifier (build context: the repository root):
#   docker build -f deploy/docker/spark-job.Dockerfile -t spark-eos-job .
# [spark] gives pyspark; [server] the Kafka wire client the verifier lists open transactions with.
# PySpark needs a Java 17 runtime: Debian bookworm's openjdk-17-jre-headless. procps gives the e2e
# suite `pkill` to kill a PySpark Python worker (an executor task's process) inside the container.

FROM python:3.11-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY coordinator ./coordinator
COPY migrations ./migrations
COPY sparkclient ./sparkclient
COPY e2e ./e2e
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/venv \
 && WHEEL=$(ls /wheels/*.whl) \
 && /opt/venv/bin/pip install "${WHEEL}[spark,server]"

FROM python:3.11-slim-bookworm
# not pinned to Debian revisions (DL3008): bookworm's security updates replace them
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    CHECKPOINT_LOCATION=/data/checkpoints/demo
# Spark (Hadoop's UserGroupInformation) needs the uid to have a name
RUN groupadd --gid 10001 spark \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin spark \
 && mkdir -p /data/checkpoints && chown -R 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /tmp
VOLUME ["/data/checkpoints"]
CMD ["python", "-m", "sparkclient.example_job"]
