"""The GPT model (readable on one device), its Domino layer stack, KV cache, sharding and HF mapping."""

from domino.model.gpt_model import GPTModel
from domino.model.kv_cache import KVCache

__all__ = ["GPTModel", "KVCache"]
