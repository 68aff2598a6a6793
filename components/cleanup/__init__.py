"""Cleanup component: the pipeline's exit handler; deletes training jobs a run left behind."""
