"""Preprocess component: raw text or a built-in corpus to ``.bin/.idx`` on the shared volume."""
