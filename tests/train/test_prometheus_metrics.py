"""Rank 0's Prometheus endpoint: off by default; with --metrics-port a real `domino pretrain` serves the logging
interval's numbers (the same as its metrics file's), and the rendered pod declares the port."""

from __future__ import annotations

import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from distributed_helpers import free_port
from train_helpers import child_env, pretrain_command, read_metrics

BASE = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--eval-iters", "0", "--eval-interval", "0"]


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_training_serves_tokens_loss_mfu_and_step_time_on_the_metrics_port(tmp_path):
    port, metrics = free_port(), tmp_path / "m.jsonl"
    proc = subprocess.Popen(pretrain_command([*BASE, "--train-iters", "100000", "--metrics-file", str(metrics),
                                              "--metrics-port", str(port), "--save", str(tmp_path / "ckpt")]),
                            env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 240, {}
        while time.monotonic() < deadline and seen.get("domino_iteration", 0) < 3:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                seen = scrape(port)
            except OSError:  # not listening yet (model and data still being built)
                pass
            time.sleep(0.5)
        assert seen.get("domino_iteration", 0) >= 3, seen
        iteration = int(seen["domino_iteration"])
        record = next(r for r in read_metrics(metrics) if r.get("iteration") == iteration)
        assert seen["domino_train_loss"] == pytest.approx(record["lm_loss"])
        assert seen["domino_tokens_per_second"] == pytest.approx(record["tokens_per_s"])
        assert seen["domino_iteration_seconds"] == pytest.approx(record["iteration_time_s"])
        assert seen["domino_consumed_samples"] == record["consumed_samples"]
        assert ("domino_mfu" in seen) == (record["mfu"] is not None)  # no known peak on this CPU: absent
        assert seen["domino_goodput"] == pytest.approx(record["goodput"]) and 0 < record["goodput"] < 1  # --save
    finally:
        proc.kill()
        proc.wait(30)


def test_off_by_default_and_closing_frees_the_port():
    from domino.config.schema import LoggingConfig
    from domino.train.metrics import MetricsWriter
    from domino.train.prometheus import PrometheusExporter

    assert LoggingConfig().metrics_port == 0
    assert MetricsWriter(None, None, enabled=True).exporter is None
    port = free_port()
    assert MetricsWriter(None, None, enabled=False, metrics_port=port).exporter is None  # rank 0 only
    exporter = PrometheusExporter(port, addr="127.0.0.1")
    exporter.update({"iteration": 5, "lm_loss": 3.5, "tokens_per_s": 1000.0, "mfu": None})
    seen = scrape(port)
    assert seen["domino_iteration"] == 5 and seen["domino_train_loss"] == 3.5
    assert "domino_mfu" not in seen  # unknown (no peak for this device): absent, not 0
    exporter.update({"iteration": 6, "mfu": 0.41, "goodput": 0.5, "goodput_s": {"wall_s": 10.0, "productive_s": 5.0}})
    assert scrape(port)["domino_mfu"] == 0.41
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        parts = {s.labels["part"]: s.value for family in text_string_to_metric_families(response.read().decode())
                 for s in family.samples if s.name == "domino_goodput_seconds"}
    assert parts == {"wall": 10.0, "productive": 5.0} and scrape(port)["domino_goodput"] == 0.5
    exporter.close()
    PrometheusExporter(port, addr="127.0.0.1").close()  # the port is free again


def test_the_rendered_pytorchjob_declares_the_metrics_port():
    from domino.launch import JobSpec
    from domino.launch.render import render_job

    job = render_job(JobSpec(name="gpt", image="i", nodes=2, pretrain_args=["--preset", "tiny", "--metrics-port",
                                                                             "9400"]), run_id="r")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        ports = replica["template"]["spec"]["containers"][0]["ports"]
        assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in ports
    plain = render_job(JobSpec(name="gpt", image="i"), run_id="r")
    assert [p["name"] for p in plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
            ["ports"]] == ["pytorchjob-port"]
