"""Pretrain component: a distributed ``domino pretrain`` job (PyTorchJob or local) to a checkpoint."""
