"""Promote component: records a model that passed the evaluation gate in the promotion registry."""
