"""In-process restart (``--inprocess-restart``) with real processes under real torchrun: an exception raised in
one rank's step (``DOMINO_FAULT_INJECT=raise-in-step@5:1``) while its peer waits in the step's first TP
collective is survived by the same two processes under ``--max-restarts 0``, and the run ends with the
uninterrupted run's losses; without the flag the same fault ends the job. With ``--async-save`` the fault comes
right after the save of iteration 4 began (its commit would come at the next step boundary), and the restart
resumes that save, not iteration 2's (``domino.checkpoint.inflight``)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from domino.goodput.accounting import account, format_report
from domino.goodput.ledger import read_events
from domino.launch.signal_relay import command_environment, torchrun_max_restarts
from domino.runtime.state import UNSHARED_STORE_ENV, check_worker_restarts
from train_helpers import child_env, pretrain_command, train_losses

FAULT = {"DOMINO_FAULT_INJECT": "raise-in-step@5:1"}


def _torchrun(tmp_path, name, extra=(), env=None, timeout=240, tp=2, max_restarts=0) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 --max-restarts 0 -m domino pretrain` at TP ``tp`` (else DP 2), 8 iterations,
    saves every 2."""
    save = tmp_path / name
    args = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--num-workers", "0", "--seed", "7",
            "--log-interval", "1", "--tensor-model-parallel-size", str(tp), "--train-iters", "8", "--save-interval", "2",
            "--save", str(save), "--load", str(save), "--metrics-file", str(tmp_path / f"{name}.jsonl"),
            "--eval-iters", "0", "--eval-interval", "0", "--distributed-timeout-minutes", "1", *extra]
    command = pretrain_command(args, nproc=2)
    at = command.index("torch.distributed.run") + 1
    command[at:at] = ["--max-restarts", str(max_restarts)]
    return subprocess.run(command, env=child_env(env), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2-zero1-workers-async-save"])
def test_a_step_that_raises_on_one_rank_is_survived_by_the_same_processes(tmp_path, tp):
    """TP 2: rank 0 waits in the step's first TP broadcast. DP 2 (ZeRO 1, two loader workers per rank,
    ``--async-save``): rank 0 waits in the gradient reduction, the failed try's ZeRO hooks must go (DeepSpeed's
    engine.destroy()), and the save of iteration 4, still uncommitted at the fault, is the one resumed."""
    workers = [] if tp == 2 else ["--num-workers", "2", "--async-save"]
    plain = _torchrun(tmp_path, "plain", workers[:2], tp=tp)  # saved synchronously: the same losses
    assert plain.returncode == 0, plain.stderr[-3000:]
    proc = _torchrun(tmp_path, "faulted", ["--inprocess-restart", *workers], FAULT, tp=tp)
    assert proc.returncode == 0, proc.stderr[-6000:]
    log = proc.stderr
    # The fault fired on rank 1, and rank 1's same process formed the groups again (torchrun restarted nobody:
    # --max-restarts 0 would have ended the job on a worker's exit).
    raised = re.search(r"\[rank 1\] WARNING .*fault injection: rank 1 \(pid (\d+)\) raises in its step 5", log)
    assert raised, log[-4000:]
    formed = dict(re.findall(r"\[rank (\d)\] WARNING .*in-process restart 1: process groups formed again in "
                             r"[\d.]+ s \(pid (\d+)\)", log))
    assert formed.get("1") == raised.group(1), log[-4000:]
    # Rank 0 was woken from its collective by rank 1 leaving its groups (not by the 1-minute timeout), and found
    # rank 1 checked in as alive (without waiting 10 s for it).
    woken = re.search(r"\[rank 0\] WARNING .*in-process restart 1 of 3 after: PeerLostError: (.*)", log)
    assert woken and "every rank still answers" in woken.group(1), log[-4000:]
    assert "rank 0 saw: Connection closed by peer" in woken.group(1), log[-4000:]
    assert re.search(r"resumed from \S*iter_0000004 at iteration 4", log), log[-4000:]
    kept = "the save in flight at the failure" if tp == 1 else "the newest checkpoint"
    assert f"in-process restart 1 resumed from iteration 4: {kept}" in log, log[-4000:]
    losses, expected = train_losses(tmp_path / "faulted.jsonl"), train_losses(tmp_path / "plain.jsonl")
    assert sorted(losses) == list(range(1, 9))
    assert [losses[i] for i in range(5, 9)] == [expected[i] for i in range(5, 9)]
    # The goodput ledger: the failed try and the retry, two attempts of rank 0's one process.
    events = read_events(str(tmp_path / "faulted"))
    assert [e["how"] for e in events if e["event"] == "end"] == ["failed", "finished"]
    starts = [e for e in events if e["event"] == "start"]
    assert [e["pid"] for e in starts] == [int(formed["0"])] * 2
    assert [e.get("inprocess_restart", 0) for e in starts] == [0, 1]
    assert [e["loaded_iteration"] for e in starts] == [0, 4]
    failed_end = next(e["t"] for e in events if e["event"] == "end")
    assert starts[0]["process_start"] < starts[1]["process_start"] <= failed_end + 1  # began at the failure
    report = account(events)
    assert [a.inprocess_restart for a in report.attempts] == [0, 1]
    assert "in-process restarts (--inprocess-restart): 1, recovering in" in format_report(report)


def test_a_dead_rank_takes_torchruns_worker_restart_which_forms_the_groups_again_on_the_shared_store(tmp_path):
    """Rank 1 dies in its step 5 (SIGKILL) under --inprocess-restart and `torchrun --max-restarts 1 --master-addr
    ... --master-port ...` (its static rendezvous: one TCPStore, the agent's, for every round). No process can
    come back in-process: torchrun sees the dead worker and restarts both (rank 0 may be losing its peer, or
    waiting for it at the restart barrier), which resume from iteration 4. Before the round's prefix (domino.runtime.state.restarted_round_store) the restarted
    ranks read the first round's keys and waited in init_process_group until the test's timeout."""
    proc = _torchrun(tmp_path, "faulted", ["--inprocess-restart"], {"DOMINO_FAULT_INJECT": "kill-in-step@5:1"},
                     max_restarts=1, timeout=120)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "fault injection: rank 1" in proc.stderr and "dies in its step 5" in proc.stderr
    assert "resumed from" in proc.stderr and "iter_0000004" in proc.stderr
    assert "shares its agent's TCPStore" not in proc.stderr  # one node: no line
    assert sorted(train_losses(tmp_path / "faulted.jsonl")) == list(range(1, 9))
    starts = [e for e in read_events(str(tmp_path / "faulted")) if e["event"] == "start"]
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]  # new worker processes


def test_the_shared_store_under_worker_restarts_is_named_before_any_work():
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "2"}
    line = check_worker_restarts(shared)
    assert line.startswith("torchrun --max-restarts 3 on 2 nodes shares its agent's TCPStore") and \
        UNSHARED_STORE_ENV in line
    assert check_worker_restarts({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert check_worker_restarts({**shared, "GROUP_WORLD_SIZE": "1"}) is None  # one agent: the rounds agree
    assert check_worker_restarts({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # switch set
    assert check_worker_restarts({}) is None
    # The relay sets the switch for a torchrun that restarts workers, and keeps a user's own value.
    assert torchrun_max_restarts(["torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts=2", "t.py"]) == 2
    assert torchrun_max_restarts([sys.executable, "-m", "torch.distributed.run", "-m", "--max_restarts", "1",
                                  "domino"]) == 1
    assert torchrun_max_restarts(["torchrun", "--nnodes", "2", "train.py", "--max-restarts", "5"]) == 0  # the script's
    assert torchrun_max_restarts(["python", "train.py", "--max-restarts", "5"]) == 0
    assert command_environment(["torchrun", "t.py"], {}) == {}
    assert command_environment(["torchrun", "--max-restarts", "1", "t.py"],
                               {UNSHARED_STORE_ENV: "0"}) == {UNSHARED_STORE_ENV: "0"}


def test_without_the_flag_the_same_fault_ends_the_job(tmp_path):
    proc = _torchrun(tmp_path, "faulted", env=FAULT)
    assert proc.returncode != 0
    assert "fault injection: rank 1" in proc.stderr and "in-process restart" not in proc.stderr
    assert max(train_losses(tmp_path / "faulted.jsonl")) == 4
