"""Merge component: the shard groups' datasets, concatenated in order, as the run's Dataset."""
