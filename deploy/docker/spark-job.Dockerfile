# The example Spark job and the read_committed verifier (build context: the repository root):
#   docker build -f deploy/docker/spark-job.Dockerfile -t spark-eos-job .
# [spark] gives pyspark; [server] the Kafka wire client the verifier lists open transactions with.
# PySpark needs a Java 17 runtime: Debian bookworm's openjdk-17-jre-headless. procps gives the e2e
# suite `pkill` to kill a PySpark Python worker (an executor task's process) inside the container.
# PYTHON_IMAGE, deploy/image-inputs/: as in the coordinator's Dockerfile. Spark's Kafka connector
# comes from deploy/image-inputs/spark-jars/ when it holds jars (resolved by Maven on the host),
# otherwise Maven resolves it here through localkafka's pom.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY deploy/image-inputs/ /image-inputs/
COPY pyproject.toml README.md ./
COPY coordinator ./coordinator
COPY migrations ./migrations
COPY sparkclient ./sparkclient
COPY e2e ./e2e
COPY localkafka ./localkafka
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN if ls /image-inputs/wheels/*.whl > /dev/null 2>&1; then \
      export PIP_NO_INDEX=1 PIP_FIND_LINKS=/image-inputs/wheels; fi \
 && pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/venv \
 && WHEEL=$(ls /wheels/*.whl) \
 && /opt/venv/bin/pip install "${WHEEL}[spark,server]" \
 && mkdir -p /opt/spark-jars \
 && if ls /image-inputs/spark-jars/*.jar > /dev/null 2>&1; then \
      cp /image-inputs/spark-jars/*.jar /opt/spark-jars/; \
    else \
      apt-get update && apt-get install -y --no-install-recommends maven openjdk-17-jre-headless \
      && /opt/venv/bin/python -m localkafka classpath spark | xargs -I{} cp {} /opt/spark-jars/; \
    fi

FROM ${PYTHON_IMAGE}
# not pinned to Debian revisions (DL3008): bookworm's security updates replace them
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    SPARK_JARS=/opt/spark-jars/*.jar \
    CHECKPOINT_LOCATION=/data/checkpoints/demo
# Spark (Hadoop's UserGroupInformation) needs the uid to have a name
RUN groupadd --gid 10001 spark \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin spark \
 && mkdir -p /data/checkpoints && chown -R 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/spark-jars /opt/spark-jars
USER 10001:10001
WORKDIR /tmp
VOLUME ["/data/checkpoints"]
CMD ["python", "-m", "sparkclient.example_job"]
