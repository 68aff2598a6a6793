"""Per-run job names and the labels that identify a run's job.

The training operator names pods and services ``<job>-master-0`` and ``<job>-worker-<i>``; both must be
DNS-1035 labels of at most 63 characters, so the job name leaves room for the longest suffix. The name
is a pure function of (base name, run id): a retry of the same pipeline run computes the same name and
adopts its own job, while a different run never collides with it.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import uuid
from typing import Dict, Optional

MAX_NAME = 63
RUN_ID_LABEL = "domino/run-id"
OWNER_LABEL = "domino/owner"
JOB_LABEL = "domino/job"
RUN_ID_ANNOTATION = "domino/run-id"
MANAGED_BY = {"app.kubernetes.io/name": "domino", "app.kubernetes.io/managed-by": "domino-launch"}
#: Labels the training operator (v1.9) puts on every pod of a job.
OPERATOR_JOB_LABEL = "training.kubeflow.org/job-name"
OPERATOR_REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"


def new_run_id() -> str:
    """A fresh random run id (used when the caller gives none)."""
    return uuid.uuid4().hex[:12]


def pod_suffix_length(nodes: int) -> int:
    """Length of the longest operator pod suffix: ``-master-0`` or ``-worker-<nodes-2>``."""
    longest = len("-master-0")
    if nodes > 1:
        longest = max(longest, len(f"-worker-{nodes - 2}"))
    return longest


def _slug(text: str) -> str:
    """Lowercase DNS-label characters only, runs of others collapsed to one '-'."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


def run_suffix(run_id: str) -> str:
    """A short DNS-safe token for ``run_id``: the id itself when short and clean, else a stable hash."""
    slug = _slug(run_id)
    if slug == run_id and 0 < len(slug) <= 12:
        return slug
    return hashlib.sha256(run_id.encode()).hexdigest()[:10]


def job_name(base: str, run_id: str, nodes: int) -> str:
    """The job name for ``base`` in run ``run_id``: ``<base>-<suffix>``, DNS-1035, pods' names <= 63."""
    budget = MAX_NAME - pod_suffix_length(nodes)
    suffix = run_suffix(run_id)
    head = _slug(base)[: max(1, budget - len(suffix) - 1)].rstrip("-")
    if not head or not head[0].isalpha():
        head = ("j" + head)[: max(1, budget - len(suffix) - 1)].rstrip("-")
    return f"{head}-{suffix}"


def label_value(text: str) -> str:
    """``text`` as a valid label value (<= 63 chars); long or unusual values get a hash suffix."""
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", text).strip("-_.")
    if clean == text and len(clean) <= 63:
        return clean
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return (clean[:52].strip("-_.") + "-" + digest).strip("-")


def default_owner() -> str:
    """The launching user: ``$DOMINO_OWNER``, else the login name, else ``domino``."""
    owner = os.environ.get("DOMINO_OWNER")
    if not owner:
        try:
            owner = getpass.getuser()
        except Exception:  # no passwd entry in some containers
            owner = "domino"
    return owner


def run_labels(run_id: str, owner: Optional[str], name: str) -> Dict[str, str]:
    """Labels that identify the run, the owner and the job (on the job and every pod)."""
    return {
        **MANAGED_BY,
        RUN_ID_LABEL: label_value(run_id),
        OWNER_LABEL: label_value(owner or default_owner()),
        JOB_LABEL: name,
    }
