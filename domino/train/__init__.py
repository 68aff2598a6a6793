"""Pretraining: the DeepSpeed loop, LR schedules, checkpoints, evaluation and metrics."""
