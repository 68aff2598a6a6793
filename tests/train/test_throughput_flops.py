"""The FLOPs per token behind TFLOP/s and MFU (domino/train/throughput.py) against a hand count."""

from domino.config import ModelConfig
from domino.train.throughput import training_flops_per_token


def test_hand_count_for_one_config():
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    h, s, f, vocab = 64, 64, 256, 256  # ffn defaults to 4h
    qkv, dense, fc1, fc2 = 2 * h * 3 * h, 2 * h * h, 2 * h * f, 2 * f * h  # per token, multiply-add = 2 FLOPs
    scores, values = 2 * s * h, 2 * s * h  # QK^T and AV over the full s x s square
    per_layer = qkv + dense + fc1 + fc2 + scores + values
    forward = 2 * per_layer + 2 * h * vocab  # two layers, then the logits
    assert training_flops_per_token(model, vocab) == 3 * forward == 786432



def test_hand_count_for_a_llama_config():
    """GQA shrinks the key/value projections, SwiGLU adds a third MLP matrix."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, ffn_hidden_size=160,
                        swiglu=True, group_query_attention=True, num_query_groups=2)
    h, s, f, d, vocab = 64, 64, 160, 16, 256
    q, kv, dense, gate_up, down = 2 * h * h, 2 * h * 2 * (2 * d), 2 * h * h, 2 * h * 2 * f, 2 * f * h
    per_layer = q + kv + dense + gate_up + down + 4 * s * h
    assert training_flops_per_token(model, vocab) == 3 * (2 * per_layer + 2 * h * vocab)
