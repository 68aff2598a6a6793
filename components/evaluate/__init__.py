"""Evaluate component: test metrics, HTML report and the promotion gate."""
