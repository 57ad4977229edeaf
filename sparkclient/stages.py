"""Stage retries of the driver's write job, seen through Spark's status tracker.

A partition's first try writes on the id begin pre-leased for it, and a task knows it is the first
try by its task attempt number 0. PySpark's TaskContext does not tell the stage attempt, though:
after a stage retry (a fetch failure), a task of the new stage attempt is attempt 0 again while
the old one may still run, and both would write on the partition's pre-lease. So the driver notes
its job ids before the write job and, if any stage of the jobs it ran was retried, aborts the
attempt and begins the batch again (fresh pre-leases; the old ones are aborted on Kafka and
quarantined). Where there is no status tracker (Spark Connect) the driver asks for no pre-leases
and every task leases its own.
"""

from __future__ import annotations

from typing import Any

RUN_GROUP_PROPERTY = "spark.jobGroup.id"  # StreamExecution runs every batch in a job group named by its run id


class StageRetries:
    def __init__(self, sc: Any) -> None:
        self.sc = sc
        self.tracker = sc.statusTracker()

    @classmethod
    def of(cls, df: Any) -> StageRetries | None:
        """None where the driver has no SparkContext (Spark Connect): ask for no pre-leases then."""
        try:
            return cls(df.sparkSession.sparkContext)
        except Exception:  # noqa: BLE001 - Connect raises its own error types here
            return None

    def job_ids(self) -> set[int]:
        return set(self.tracker.getJobIdsForGroup(self.sc.getLocalProperty(RUN_GROUP_PROPERTY)))

    def retried(self, job_ids: set[int]) -> bool:
        """True if a stage of these jobs ran more than one stage attempt."""
        for job_id in job_ids:
            job = self.tracker.getJobInfo(job_id)
            for stage_id in (job.stageIds if job else []):
                stage = self.tracker.getStageInfo(stage_id)
                if stage is not None and stage.currentAttemptId > 0:
                    return True
        return False
