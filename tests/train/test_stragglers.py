"""--log-straggler: a rank slowed by a SIGSTOP/SIGCONT duty cycle is named; the rank that waits for it is not.

Real torchrun (torch 2.13), TP 2: the test stops rank 1 for 70 ms of every 80 ms while it trains. Rank 1 then
computes longer and waits less in the TP all-reduces; rank 0 waits for it. Without subtracting the time blocked
in collectives both ranks would show the same wall time per step and neither would stand out (checked). Waits
outside the TP collectives (the batch broadcast, the gradient-norm all-reduce) are not subtracted, which narrows
the gap: rank 0's compute rises under the duty cycle too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

from domino.launch.processes import children, process_tree, signal_tree
from domino.train.stragglers import stragglers
from train.train_helpers import child_env, pretrain_command, rank_of, read_metrics

ARGS = ["--preset", "tiny", "--seed", "7", "--mock-data", "--vocab-size", "256", "--num-workers", "0",
        "--tensor-model-parallel-size", "2", "--train-iters", "100000", "--log-interval", "8", "--eval-iters", "0",
        "--eval-interval", "0", "--log-straggler"]


def _duty_cycle(pid: int, stop: threading.Event) -> None:
    while not stop.is_set():
        signal_tree([pid], signal.SIGSTOP)
        time.sleep(0.07)
        signal_tree([pid], signal.SIGCONT)
        time.sleep(0.01)


def test_a_rank_slowed_by_a_duty_cycle_is_named_and_its_peer_is_not(tmp_path):
    metrics = tmp_path / "m.jsonl"
    save = tmp_path / "ckpt"
    proc = subprocess.Popen(pretrain_command([*ARGS, "--metrics-file", str(metrics), "--save", str(save)], nproc=2),
                            env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(read_metrics(metrics)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        quiet = read_metrics(metrics)
        ranks = sorted(children(proc.pid), key=rank_of)
        slower = threading.Thread(target=_duty_cycle, args=(ranks[1], stop), daemon=True)
        slower.start()
        before = len(quiet)
        while len(read_metrics(metrics)) < before + 4:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        stop.set()
        slower.join()
    finally:
        stop.set()
        signal_tree(process_tree(proc.pid), signal.SIGCONT)
        signal_tree(process_tree(proc.pid), signal.SIGKILL)
        output = proc.communicate()[0]
    slowed = read_metrics(metrics)[before + 1:before + 4]  # whole intervals under the duty cycle
    # On a loaded 2-core machine one interval may be noisy: rank 1 named in most, rank 0 in none (the ratio seen
    # here: 1.2-3.8 under the duty cycle, 0.8-1.2 without it; 1.45 once with two test workers and other jobs).
    named = [[s["rank"] for s in record["stragglers"]] for record in slowed]
    assert named.count([1]) >= 2 and not any(0 in n for n in named), slowed
    assert sum(r["compute_s_by_rank"][1] for r in slowed) > 1.2 * sum(r["compute_s_by_rank"][0] for r in slowed)
    assert "stragglers: rank 1 (" in output
    ledger = json.loads(subprocess.run([sys.executable, "-m", "domino", "goodput", "--load", str(save), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert ledger["straggler_s"] > 0  # what the slow rank cost, in the goodput ledger



def test_the_rule_names_ranks_over_110_percent_of_the_median():
    found = stragglers([1.0, 1.0, 1.3, 2.0], ["a", "b", "c", "d"])  # median 1.15
    assert [(s["rank"], s["host"]) for s in found["stragglers"]] == [(3, "d"), (2, "c")]
    assert found["straggler_slowest_ratio"] == 2.0 / 1.15
    assert stragglers([1.0, 1.0], ["a", "b"])["stragglers"] == []
