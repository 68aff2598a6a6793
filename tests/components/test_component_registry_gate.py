"""Promotion registry (atomic, validated), the gate's rule, and the promote step."""

import json
import math
import os

import pytest

from components.evaluate.step import decide
from components.layout import RunLayout
from components.manifest import write_manifest
from components.promote.step import run_promote
from components.registry import PromotedModel, RegistryError, current_model, lock_path, promote, read_registry
from domino.file_lock import exclusive_lock


def _entry(run_id, ppl):
    return PromotedModel(run_id=run_id, checkpoint_dir=f"/ckpt/{run_id}", test_ppl=ppl, test_loss=math.log(ppl))


def test_empty_registry_then_promotions_keep_history(tmp_path):
    path = str(tmp_path / "promoted.json")
    assert current_model(path) is None
    promote(path, _entry("a", 30.0))
    promote(path, _entry("b", 20.0))
    registry = read_registry(path)
    assert registry["current"].run_id == "b" and registry["current"].promoted_at > 0
    assert [e.run_id for e in registry["history"]] == ["a", "b"]
    assert sorted(os.listdir(tmp_path)) == [".promoted.json.lock", "promoted.json"]  # no temporaries; the lock stays


def test_corrupt_registry_is_an_error_naming_the_file_and_is_not_overwritten(tmp_path):
    path = tmp_path / "promoted.json"
    path.write_text("{not json")
    with pytest.raises(RegistryError, match=f"promotion registry {path}: unreadable"):
        promote(str(path), _entry("a", 3.0))
    assert path.read_text() == "{not json"
    path.write_text(json.dumps({"current": {"run_id": "x"}, "history": []}))
    with pytest.raises(RegistryError, match="lacks keys \\['checkpoint_dir', 'test_loss', 'test_ppl'\\]"):
        current_model(str(path))


@pytest.mark.parametrize("new, incumbent_ppl, min_improvement, expected", [
    (10.0, None, 0.0, True),          # nothing promoted yet
    (9.0, 10.0, 0.0, True),           # better
    (10.0, 10.0, 0.0, False),         # equal is not better
    (11.0, 10.0, 0.0, False),         # worse
    (9.5, 10.0, 0.1, False),          # better, but not by 10 %
    (8.9, 10.0, 0.1, True),
    (float("nan"), None, 0.0, False),  # a diverged model never promotes
])
def test_gate_rule(new, incumbent_ppl, min_improvement, expected):
    incumbent = _entry("old", incumbent_ppl) if incumbent_ppl is not None else None
    decision = decide(new, incumbent, incumbent_ppl, min_improvement)
    assert decision.promote is expected
    assert decision.reason


def test_promote_step_writes_the_registry_only_when_the_gate_said_so(tmp_path):
    root = str(tmp_path)
    model = str(tmp_path / "model.json")
    write_manifest(model, {"checkpoint_dir": "/ckpt/r1", "iterations": 12, "tokens_seen": 3072})
    no = str(tmp_path / "no.json")
    write_manifest(no, {"promote": False, "test_ppl": 5.0, "test_loss": 1.6, "reason": "worse"})
    with pytest.raises(ValueError, match="the gate did not promote this model \\(worse\\)"):
        run_promote(root, "r1", model, no)
    assert current_model(RunLayout(root, "r1").registry_path) is None
    yes = str(tmp_path / "yes.json")
    write_manifest(yes, {"promote": True, "test_ppl": 5.0, "test_loss": 1.6, "reason": "better"})
    entry = run_promote(root, "r1", model, yes)
    assert entry["checkpoint_dir"] == "/ckpt/r1" and entry["iteration"] == 12 and entry["tokens"] == 3072
    assert current_model(os.path.join(root, "promoted.json")).test_ppl == 5.0


@pytest.mark.parametrize("decision, message", [
    ({"test_ppl": 5.0, "test_loss": 1.6, "reason": "?"}, "field 'promote' is missing"),
    ({"promote": "false", "test_ppl": 5.0, "test_loss": 1.6}, "field 'promote' is 'false'"),
    ({"promote": 1, "test_ppl": 5.0, "test_loss": 1.6}, "field 'promote' is 1"),
    ({"promote": None, "test_ppl": 5.0, "test_loss": 1.6}, "field 'promote' is None"),
    ({"promote": True, "test_loss": 1.6}, "field 'test_ppl' is None"),
    ({"promote": True, "test_ppl": float("nan"), "test_loss": 1.6}, "field 'test_ppl' is nan"),
    ({"promote": True, "test_ppl": "5", "test_loss": 1.6}, "field 'test_ppl' is '5'"),
    ([{"promote": True}], "expected a JSON object, got list"),
], ids=["missing", "string-false", "one", "null", "no-ppl", "nan-ppl", "string-ppl", "not-an-object"])
def test_a_missing_or_malformed_decision_never_promotes(tmp_path, decision, message):
    model, path = str(tmp_path / "model.json"), tmp_path / "decision.json"
    write_manifest(model, {"checkpoint_dir": "/ckpt/r1", "iterations": 12, "tokens_seen": 3072})
    path.write_text(json.dumps(decision))
    with pytest.raises(ValueError, match=f"decision {path}: {message}"):
        run_promote(str(tmp_path), "r1", model, str(path))
    assert not (tmp_path / "promoted.json").exists()
    path.write_text("{truncated")
    with pytest.raises(ValueError, match="decision artifact .* not a domino manifest"):
        run_promote(str(tmp_path), "r1", model, str(path))
    assert not (tmp_path / "promoted.json").exists()


def test_layout_rejects_unusable_run_ids():
    with pytest.raises(ValueError, match="run_id"):
        RunLayout("/mnt/domino", "../x")
    with pytest.raises(ValueError, match="shared_root"):
        RunLayout("", "r")
    assert RunLayout("/mnt/domino", "r").data_dir == "/mnt/domino/runs/r/data"


def test_promote_rechecks_the_incumbent_under_the_lock(tmp_path):
    """Run b's gate saw run a; run c was promoted meanwhile: b is promoted only if it beats c."""
    path = str(tmp_path / "promoted.json")
    promote(path, _entry("a", 30.0))
    promote(path, _entry("c", 20.0), gate_incumbent="a")  # c's own gate saw a: fine
    with pytest.raises(RegistryError, match="run c \\(perplexity 20.0000\\) was promoted after the gate compared "
                                            "run b \\(perplexity 25.0000\\) with a; not promoting"):
        promote(path, _entry("b", 25.0), gate_incumbent="a")
    assert current_model(path).run_id == "c"
    promote(path, _entry("d", 15.0), gate_incumbent="a")  # better than the new incumbent too
    assert current_model(path).run_id == "d"


def test_promote_waits_for_the_lock(tmp_path):
    """A thread of the same process is kept out too (record locks alone do not exclude threads)."""
    import threading

    path = str(tmp_path / "promoted.json")
    done = threading.Event()
    writer = threading.Thread(target=lambda: (promote(path, _entry("a", 3.0), gate_incumbent=""), done.set()))
    with exclusive_lock(lock_path(path)):  # another writer inside its read-check-write
        writer.start()
        assert not done.wait(1.0) and current_model(path) is None  # still blocked: nothing written
    writer.join(30)
    assert done.is_set() and current_model(path).run_id == "a"
