"""kfp declaration and glue of the exit handler (logic in ``step.py``).

The kfp function, ``components.kfp_functions.cleanup_job``, is generated from :data:`COMPONENTS` (see
``components/declare.py``).
"""

from dataclasses import dataclass
from typing import Any

from components.cleanup.step import cleanup_jobs
from components.declare import Component, Input, settings_from_values
from components.run_settings import JobTargetSettings, RunIdSettings


@dataclass(kw_only=True)
class CleanupSettings(JobTargetSettings, RunIdSettings):
    """Parameters of the cleanup-job exit handler."""

    keep_failed_jobs: bool = True
    """Keep a failed training job for debugging (its TTL removes it later)."""


COMPONENTS = (Component(
    function="cleanup_job",
    summary="Deletes the run's training job if it is still there (cancelled or crashed launcher).",
    settings=CleanupSettings,
    run="components.cleanup.component:run",
    inputs=(Input("status", "PipelineTaskFinalStatus", "Final status of the tasks inside the exit handler (filled "
                  "in by kfp)."),),
),)


def run(status: Any, **values: Any) -> None:
    """The cleanup-job component's body: local jobs end with their step, so there is nothing to do."""
    s = settings_from_values(CleanupSettings, values)
    if s.backend != "cluster":
        print(f"cleanup: backend {s.backend}: training processes ended with their step (pipeline {status.state})")
        return
    cleanup_jobs(s.run_id, s.namespace, status.state, keep_failed=s.keep_failed_jobs, job_api=s.job_api)
