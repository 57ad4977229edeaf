"""Reading the query's checkpoint files without running a Spark job: its `metadata` (the query id,
the sink's lineage) and a batch's `offsets/<batch_id>` entry (the offsets Spark planned for it, bound
to the checkpoint at its first begin).

- Driver, classic PySpark: Hadoop's FileSystem through the JVM (any file system Spark can use,
  with the session's Hadoop settings), a few py4j calls.
- Driver, Spark Connect (no JVM here): a local path is read directly (the foreachBatch function
  runs on the Connect server's host, where Spark writes a local checkpoint); any other location
  through Spark's text reader, a small Spark job, once per batch.
- Executor (the native sink's tasks): a local path directly, any other through pyarrow's file
  systems (`hdfs://`, `s3://`/`s3a://`, `gs://`, `abfs://`), cached per process and batch.

`None` means the file is not there or cannot be read; the caller decides what that means.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

_S3_ALIASES = {"s3a": "s3", "s3n": "s3"}


def offsets_path(checkpoint_location: str, batch_id: int) -> str:
    return f"{checkpoint_location.rstrip('/')}/offsets/{batch_id}"


def metadata_path(checkpoint_location: str) -> str:
    return f"{checkpoint_location.rstrip('/')}/metadata"


def offsets_digest(entry: str) -> str:
    """A digest of an offsets entry without its first two lines (the log version and the batch's
    metadata, whose timestamp is not part of what the batch reads)."""
    return "sha256:" + hashlib.sha256("\n".join(entry.splitlines()[2:]).encode()).hexdigest()


def local_path(location: str) -> str | None:
    """The local file system path of `location`, or None when it names another file system."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return parsed.path
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return location
    return None


def read_on_driver(spark: Any, path: str) -> str | None:
    """The text of a checkpoint file, read by the driver without a Spark job where it can."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        local = local_path(path)
        if local is not None and os.path.isabs(local):
            return _read_local(local)
        return _read_with_spark(spark, path)
    return _read_with_hadoop(spark, path)


def _read_local(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s: %s", path, exc)
        return None


def _read_with_hadoop(spark: Any, path: str) -> str | None:
    jvm = spark.sparkContext._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    fs = hadoop_path.getFileSystem(spark._jsparkSession.sessionState().newHadoopConf())
    if not fs.exists(hadoop_path):
        return None
    stream = fs.open(hadoop_path)
    try:
        return str(jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
    finally:
        stream.close()


def _read_with_spark(spark: Any, path: str) -> str | None:
    try:
        rows = spark.read.text(path, wholetext=True).collect()
    except Exception as exc:  # noqa: BLE001 - AnalysisException (PATH_NOT_FOUND) on both APIs
        log.debug("%s not readable with Spark's text reader: %s", path, exc)
        return None
    return str(rows[0][0]) if len(rows) == 1 else None


# --- executors -------------------------------------------------------------------------------

_CACHE: dict[str, str | None] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 64


def read_on_executor(path: str) -> str | None:
    """The text of a checkpoint file read by an executor's Python (cached per process: every task
    of a batch that runs in this worker reads its offsets entry once)."""
    with _CACHE_LOCK:
        if path in _CACHE:
            return _CACHE[path]
    local = local_path(path)
    text = _read_local(local) if local is not None else _read_with_pyarrow(path)
    with _CACHE_LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        if text is not None:
            _CACHE[path] = text
    return text


def _read_with_pyarrow(path: str) -> str | None:
    parsed = urlparse(path)
    uri = path if parsed.scheme not in _S3_ALIASES else path.replace(parsed.scheme + "://", "s3://", 1)
    try:
        from pyarrow import fs

        filesystem, inner = fs.FileSystem.from_uri(uri)
        with filesystem.open_input_stream(inner) as f:
            return bytes(f.read()).decode("utf-8")
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - an unsupported or unreachable file system: the caller says what to do
        log.warning("cannot read %s through pyarrow's file systems: %s", path, exc)
        return None


# --- the offsets binding ----------------------------------------------------------------------

OFFSETS_REQUIRED, OFFSETS_OFF = "required", "off"


class OffsetsUnavailable(RuntimeError):
    """Spark's offsets entry of the batch cannot be read, and option offsets.binding is not off."""


_WARNED: set[Any] = set()


def batch_offsets_digest(entry: str | None, path: str, binding: str, run: Any) -> str | None:
    """The digest `begin` binds the batch to. A missing entry fails the batch, unless the user
    chose `offsets.binding=off`: then begin names none (a replay over other offsets is not refused)
    and the writer says so once per run (`run`: any key of the run)."""
    if entry is not None and binding != OFFSETS_OFF:
        return offsets_digest(entry)
    if binding == OFFSETS_OFF:
        if run not in _WARNED:
            _WARNED.add(run)
            log.warning("option offsets.binding=off: batches are not bound to the offsets Spark planned for them, "
                        "so a replay over other offsets (a checkpoint restored from a backup) is not refused")
        return None
    raise OffsetsUnavailable(
        f"cannot read Spark's offsets entry {path}: the batch is bound to the offsets Spark planned for it, so the "
        "coordinator can refuse a replay over other offsets. Check that the writer's checkpoint location is the "
        "query's and readable here, or set option offsets.binding=off to write without the binding (warned once "
        "per run)")
