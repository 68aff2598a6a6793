"""kfp wrapper of the exit handler (see ``step.py``)."""

from typing import Optional

from kfp import dsl
from kfp.dsl import PipelineTaskFinalStatus

from components import default_image


def cleanup_job(status: PipelineTaskFinalStatus, run_id: str, namespace: str, backend: str = "cluster",
                job_api: str = "pytorchjob", keep_failed: bool = True):
    """Deletes the run's training job if it is still there (cancelled or crashed launcher).

    Args:
        status: Final status of the tasks inside the exit handler (filled in by kfp).
        run_id: Unique run id (the job's ``domino/run-id`` label).
        namespace: Namespace of the job.
        backend: cluster, or local (local jobs end with their step; nothing to do).
        job_api: pytorchjob or trainjob: the kind of job the pretrain step created.
        keep_failed: Keep a Failed job for debugging (its TTL removes it).
    """
    if backend != "cluster":
        print(f"cleanup: backend {backend}: training processes ended with their step (pipeline {status.state})")
        return
    from components.cleanup.step import cleanup_jobs

    cleanup_jobs(run_id, namespace, status.state, keep_failed=keep_failed, job_api=job_api)


def build(image: Optional[str] = None):
    """The cleanup component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(cleanup_job, base_image=image or default_image(), install_kfp_package=False)
