"""``domino estimate`` with pipeline parallelism: the schedule's arithmetic against Megatron's rules and torch's own
schedule tables, and per-stage memory against figures computed by hand."""

from __future__ import annotations

import json

import pytest

from domino.config import DominoConfig, ModelConfig, parse_config
from domino.config import pipeline_schedule as schedule
from domino.config.estimate import Layout, describe, describe_pipeline, estimate_layout, layout_of
from domino.config.validate import ConfigError, check_tensor_parallel_size, data_parallel_size


def _peak_chunks_in_torchs_table(name: str, p: int, m: int, v: int) -> list:
    """Per rank, the most forwards without their backward yet in torch's own schedule table (``pipeline_order`` of
    Schedule1F1B / ScheduleInterleaved1F1B, built by torch's schedule visualiser without processes; the
    interleaved runtime executes that table)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    out = []
    for row in get_schedule_ops(name, p, m, num_stages_per_rank=v):
        alive = peak = 0
        for action in row:
            if action is not None:
                alive += 1 if action.computation_type.name == "FORWARD" else -1
                peak = max(peak, alive)
        out.append(peak)
    return out


@pytest.mark.parametrize("p, m, v", [(4, 8, 1), (2, 4, 1), (4, 8, 2), (2, 4, 2), (4, 4, 2)])
def test_in_flight_micro_batches_are_megatrons_and_torchs(p, m, v):
    name = "1F1B" if v == 1 else "Interleaved1F1B"
    ours = [schedule.in_flight_chunks(r, p, m, v) for r in range(p)]
    assert ours == _peak_chunks_in_torchs_table(name, p, m, v)
    if v == 1:
        assert ours == [min(p - r, m) for r in range(p)]  # 1F1B: p - r on stage r, the first stage the most
    else:  # Megatron's warm-up 2 (p - r - 1) + (v - 1) p, plus the steady state's one forward
        assert ours == [min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p)]
        if m >= p + (p - 1) / v:  # else every forward is in the warm-up: all v m chunks
            assert schedule.in_flight_microbatches(0, p, m, v) == p + (p - 1) / v
        else:
            assert schedule.in_flight_microbatches(0, p, m, v) == m
    assert [schedule.in_flight_chunks(r, 4, 2) for r in range(4)] == [2, 2, 2, 1]  # never more than m


def test_bubble_fraction_and_bytes_between_stages():
    assert schedule.bubble_fraction(1, 8) == 0
    assert schedule.bubble_fraction(4, 8) == 3 / 11  # (p - 1) / (m + p - 1)
    assert schedule.bubble_fraction(4, 8, 2) == 3 / 19  # (p - 1) / (v m + p - 1)
    assert schedule.bubble_fraction(2, 16, 2) == 1 / 33
    # the first stage sends v m activations and v m - m gradients (its first chunk has no predecessor)
    assert schedule.p2p_bytes_per_step(0, 4, 8, 10.0) == 80.0
    assert schedule.p2p_bytes_per_step(1, 4, 8, 10.0) == 160.0
    assert schedule.p2p_bytes_per_step(3, 4, 8, 10.0, 2) == 16 * 10.0 - 8 * 10.0 + 16 * 10.0
    assert schedule.p2p_bytes_per_step(0, 1, 8, 10.0) == 0.0


def test_layer_split_follows_megatron_and_refuses_what_it_refuses():
    assert schedule.layer_split_problems(24, 4, 3) == []
    assert schedule.layer_split_problems(24, 5) == [
        "--num-layers 24 is not divisible by --pipeline-model-parallel-size 5 (every stage holds the same number of "
        "layers, as Megatron requires)"]
    assert "6 layers per stage do not split into 4 virtual stages" in schedule.layer_split_problems(24, 4, 4)[0]
    assert "needs --pipeline-model-parallel-size >= 2" in schedule.layer_split_problems(24, 1, 2)[0]
    assert schedule.microbatch_problems(8, 4, 2) == [] and schedule.microbatch_problems(6, 4, 1) == []
    assert "multiple of --pipeline-model-parallel-size 4" in schedule.microbatch_problems(6, 4, 2)[0]
    with pytest.raises(ValueError, match="--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"):
        estimate_layout(_tiny(), Layout(pipeline_model_parallel_size=3))
    with pytest.raises(ValueError, match=r"micro-batches per step \(1: global batch"):  # 8 / (micro 8 x DP 1)
        estimate_layout(_tiny(), Layout(micro_batch_size=8, pipeline_model_parallel_size=2,
                                        virtual_pipeline_model_parallel_size=2))


def test_world_is_tp_x_pp_x_dp():
    check_tensor_parallel_size(8, 2, 4)
    with pytest.raises(ConfigError, match="^world size 8 is not divisible by --tensor-model-parallel-size 2 x "
                                          "--pipeline-model-parallel-size 3$"):
        check_tensor_parallel_size(8, 2, 3)
    with pytest.raises(ConfigError, match="^world size 6 is not divisible by --tensor-model-parallel-size 4$"):
        check_tensor_parallel_size(6, 4)
    config = _tiny().replace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert data_parallel_size(config, 8) == 2
    layout = layout_of(config, 8)
    assert (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
            layout.data_parallel_size) == (2, 2, 2)


def _tiny(untied: bool = False) -> DominoConfig:
    """fp32, no dropout: h 64, 4 heads, 4 layers, s 32, vocabulary 128 (already a multiple of 128)."""
    config = DominoConfig(model=ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                                            vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0,
                                            untie_embeddings_and_output_weights=untied))
    return config.replace(micro_batch_size=2, global_batch_size=8)  # 4 micro-batches per step


def test_per_stage_memory_by_hand():
    """PP 2 x DP 1, fp32, ZeRO 0, micro-batch 2, 4 micro-batches; every figure below written out by hand."""
    h, s, b, V, positions, a = 64, 32, 2, 128, 32, 4
    layer = 12 * h * h + 13 * h  # Megatron's per-layer count: QKV, projection, MLP, two LayerNorms, biases
    first = 2 * layer + V * h + positions * h  # two layers, word and position embeddings
    last = 2 * layer + 2 * h + V * h  # two layers, the final LayerNorm, the tied word-embedding copy
    sbh = s * b * h
    # per layer and micro-batch in fp32 (4 bytes): norms' inputs/outputs 4, q/k/v 3 + the projection's input 1,
    # the fused attention's output 1 (+ a logsumexp per head and row), fc1's output 4 and fc2's input 4 (ffn 4h)
    act_layer = 4 * (4 + 4 + 1 + 8) * sbh + 4 * a * s * b
    qkv_copies = 2 * h * 3 * h * 4  # the regrouped QKV weight of each of the stage's two layers
    first_activations = 2 * (2 * act_layer)  # 1F1B: stage 0 holds p - 0 = 2 micro-batches of its two layers
    last_activations = 2 * act_layer + 4 * sbh * 2  # one micro-batch; the final norm's input and output
    logits = s * b * V * 4  # the fp32 softmax of the last stage (CPU: all rows)
    # torch's PipelineStage: on stage 0 a gradient receive buffer per micro-batch and the 2 outputs in flight,
    # kept for their backward; on stage 1 an activation receive buffer per micro-batch ([b, s, h] fp32 each)
    torch_first, torch_last = (4 + 2) * 4 * sbh, 4 * 4 * sbh
    # a backward after the first runs beside all gradients (they accumulate over the 4 micro-batches)
    total_first = 16 * first + qkv_copies + torch_first + first_activations
    total_last = 16 * last + qkv_copies + torch_last + last_activations + logits

    config = _tiny()
    pp2 = Layout(zero_stage=0, micro_batch_size=2, pipeline_model_parallel_size=2)
    est = estimate_layout(config, pp2, device="cpu", peak_tflops=1.0, mfu=0.5)
    assert est.stage_totals == pytest.approx([total_first, total_last])
    assert est.stage == 0 and est.total == pytest.approx(total_first)
    assert est.weights == 4 * first and est.activations == pytest.approx(first_activations) and est.logits == 0
    assert est.parameters == 4 * layer + V * h + positions * h + 2 * h  # the tied copy is not another parameter
    assert est.num_microbatches == 4 and est.bubble_fraction == pytest.approx(1 / 5)
    assert est.p2p_bytes_per_step == 4 * sbh * 4  # 4 activations forward from stage 0, 4 gradients back
    flops = est.flops_per_token
    assert est.step_time_s == pytest.approx(8 * s * flops / (2 * 1e12 * 0.5) / (1 - 1 / 5))
    assert "TP 1 x PP 2 x DP 1" in describe(est) and "on stage 0 of 2, 4 micro-batches, bubble 20.0%" in describe(est)
    assert describe_pipeline(est).startswith(f"total per stage {total_first / 2**30:.2f}, {total_last / 2**30:.2f} GiB")
    pipeline = est.to_json()["pipeline"]
    assert pipeline["stage_of_the_figures"] == 0 and pipeline["num_microbatches"] == 4
    assert pipeline["bubble_fraction"] == pytest.approx(0.2)
    one = estimate_layout(config, Layout(zero_stage=0, micro_batch_size=2), device="cpu")
    assert one.weights == 4 * (4 * layer + V * h + positions * h + 2 * h)  # no copy at PP 1
    assert one.stage_totals == [one.total] and one.bubble_fraction == 0 and one.p2p_bytes_per_step == 0


def test_interleaved_first_stage_holds_p_plus_p_minus_1_over_v_micro_batches():
    config = _tiny().replace(num_layers=8, global_batch_size=16)  # 8 micro-batches of 2
    plain = estimate_layout(config, Layout(zero_stage=0, micro_batch_size=2, pipeline_model_parallel_size=4),
                            device="cpu")
    interleaved = estimate_layout(config, Layout(zero_stage=0, micro_batch_size=2, pipeline_model_parallel_size=4,
                                                 virtual_pipeline_model_parallel_size=2), device="cpu")
    assert plain.stage == interleaved.stage == 0
    assert interleaved.activations / plain.activations == pytest.approx((4 + 3 / 2) / 4)
    assert interleaved.bubble_fraction == pytest.approx(3 / 19) and plain.bubble_fraction == pytest.approx(3 / 11)
    assert interleaved.p2p_bytes_per_step == 2 * plain.p2p_bytes_per_step


def test_pipeline_brings_a_model_that_does_not_fit_under_the_launchers_memory_check():
    """The launcher's --gpu-memory-gb check (domino.launch.pretrain_args.check_memory_fits) estimates the layout
    the job asks for, PP included: a 30B GPT-3 (48 layers, h 7168) in bf16 at TP 8 needs 80 GiB per GPU (its ZeRO 0
    optimizer state alone 42); at TP 8 x PP 2 each stage holds half the layers and fits in 72 GiB. The first
    stage keeps 2 micro-batches of 24 layers in flight: the activations of the whole model at PP 1."""
    from domino.launch.pretrain_args import check_memory_fits
    from domino.launch.spec import LaunchSpecError

    config = parse_config(["--num-layers", "48", "--hidden-size", "7168", "--num-attention-heads", "56",
                           "--seq-length", "2048", "--vocab-size", "50257", "--bf16", "--recompute-activations",
                           "--tensor-model-parallel-size", "8", "--micro-batch-size", "1", "--global-batch-size", "16"])
    alone = estimate_layout(config, layout_of(config, 8), gpu_memory_gb=80.0)
    with pytest.raises(LaunchSpecError, match="TP 8 x DP 1, ZeRO 0, micro-batch 1, recompute selective"):
        check_memory_fits(config, 8, 80.0)
    config = config.replace(pipeline_model_parallel_size=2)  # 16 GPUs: TP 8 x PP 2 x DP 1
    staged = estimate_layout(config, layout_of(config, 16), gpu_memory_gb=80.0)
    assert staged.fits and staged.layout.data_parallel_size == 1 and staged.stage == 0
    assert staged.optimizer == pytest.approx(alone.optimizer / 2, rel=0.02)  # half, and the embedding
    assert staged.activations == pytest.approx(alone.activations, rel=0.01)
    check_memory_fits(config, 16, 80.0)


def test_layouts_rank_by_time_per_token_so_a_pipeline_comes_before_recompute_only_when_its_bubble_costs_less():
    """1F1B at PP 2 costs 3 passes / (1 - bubble): with 8 micro-batches (bubble 1/9) less than full recompute's 4
    passes, with 2 (bubble 1/3) more; with neither lever the plain layout comes first."""
    from domino.config.estimate import rank_key

    config = _tiny().replace(global_batch_size=16)
    layouts = {"plain": Layout(micro_batch_size=2, zero_stage=0),
               "pp2, 8 micro-batches": Layout(micro_batch_size=2, zero_stage=0, pipeline_model_parallel_size=2),
               "full recompute": Layout(micro_batch_size=2, zero_stage=0, recompute="full"),
               "pp2, 2 micro-batches": Layout(micro_batch_size=8, zero_stage=0, pipeline_model_parallel_size=2)}
    estimates = {name: estimate_layout(config, layout, device="cpu") for name, layout in layouts.items()}
    ranked = sorted(estimates, key=lambda name: rank_key(estimates[name]))
    assert ranked == ["plain", "pp2, 8 micro-batches", "full recompute", "pp2, 2 micro-batches"]
    plain = estimates["plain"].forward_passes_per_token
    assert estimates["pp2, 8 micro-batches"].forward_passes_per_token == pytest.approx(plain * 9 / 8)
    assert estimates["full recompute"].forward_passes_per_token == pytest.approx(plain * 4 / 3)


def test_cli_lists_a_pipeline_first_where_every_one_stage_layout_needs_full_recompute(capsys):
    """A 52B GPT in fp32 on 16 x 80 GB GPUs: at one stage only full recompute fits (TP 8 x DP 2, ZeRO 2: 4 forward
    passes per token); TP 8 x PP 2 with SP fits without recompute, and 1F1B over 64 micro-batches costs
    3 x 65/64 passes (bubble 1/65): the listing puts a pipeline without recompute first (TP 4 x PP 4, whose
    bubble of 3/67 costs less than TP 8's all-reduces over twice the layers per stage), and the JSON gives each
    stage's total."""
    from domino.cli.main import main as domino_main

    flags = ["estimate", "--num-layers", "64", "--hidden-size", "8192", "--num-attention-heads", "64",
             "--seq-length", "2048", "--vocab-size", "50257", "--eval-iters", "0", "--global-batch-size", "64",
             "--micro-batch-size", "1", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
             "--sequence-parallel", "--gpus", "16", "--gpu-memory-gb", "80", "--top", "100", "--json"]
    with pytest.raises(SystemExit) as exit_info:
        domino_main(flags)
    assert exit_info.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and len(out["pipeline"]["total_gb_per_stage"]) == 2
    assert out["pipeline"]["num_microbatches"] == 64 and out["pipeline"]["bubble_fraction"] == pytest.approx(1 / 65)
    listed = [(e["layout"]["pipeline_model_parallel_size"], e["layout"]["tensor_model_parallel_size"],
               e["layout"]["recompute"]) for e in out["layouts_that_fit"]]
    assert listed[0] == (4, 4, "none") and (2, 8, "none") in listed
    assert {recompute for pp, _, recompute in listed if pp == 1} == {"full"}


def test_a_pipelined_step_with_replicas_holds_the_gradients_twice():
    """domino averages a pipelined stage's gradients over the data-parallel replicas through one flat copy
    (domino/train/pipeline_step.py) after the schedule: with small activations that is the stage's peak."""
    config = _tiny().replace(seq_length=4, micro_batch_size=1)
    layout = Layout(data_parallel_size=2, zero_stage=0, micro_batch_size=1, pipeline_model_parallel_size=2)
    est = estimate_layout(config, layout, device="cpu")
    assert est.gradients > est.activations
    assert est.step_gradient_copy == est.gradients
    assert est.total == est.weights + est.optimizer + est.logits + est.buffers + est.fp32_grads + 2 * est.gradients
    one_replica = estimate_layout(config, Layout(zero_stage=0, micro_batch_size=1, pipeline_model_parallel_size=2),
                                  device="cpu")
    no_pipeline = estimate_layout(config, Layout(data_parallel_size=2, zero_stage=0, micro_batch_size=1),
                                  device="cpu")
    assert one_replica.step_gradient_copy == no_pipeline.step_gradient_copy == 0
