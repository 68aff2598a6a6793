"""Experiment tracking and the model registry on MLflow, on only when ``MLFLOW_TRACKING_URI`` is set.

``session`` runs every server call on a worker thread with bounded HTTP timeouts and retries, so a tracker
that is down, slow or refusing never stops training (said once, never raised); ``runs`` keeps the run pointer
beside a checkpoint and names parameters; ``training`` is what ``domino pretrain`` and ``domino evaluate`` log;
``registry`` registers promoted models. The MLflow client is optional at run time (``pip install
'domino[tracking]'``): without it, and without the variable, nothing here imports it.
"""

from domino.tracking.runs import KFP_RUN_ID_ENV, KFP_RUN_TAG, RunPointer, read_pointer
from domino.tracking.session import (CREDENTIAL_KEYS, CREDENTIAL_SECRET, TRACKING_URI_ENV, TrackingSession,
                                     tracking_uri)
from domino.tracking.training import RunTracker, evaluation_scalars, start_training_run, tracker_of_checkpoint

__all__ = ["CREDENTIAL_KEYS", "CREDENTIAL_SECRET", "KFP_RUN_ID_ENV", "KFP_RUN_TAG", "RunPointer", "RunTracker",
           "TRACKING_URI_ENV", "TrackingSession", "evaluation_scalars", "read_pointer", "start_training_run", "tracker_of_checkpoint", "tracking_uri"]
