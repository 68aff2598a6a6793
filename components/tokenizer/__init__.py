"""Train-tokenizer component: a byte-level BPE trained on the run's corpus (or a named tokenizer passed on)."""
