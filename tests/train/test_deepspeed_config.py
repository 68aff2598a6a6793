"""--deepspeed-config FILE: its keys are merged into the DeepSpeed config domino derives from the flags
(nested objects key by key, so an override of one ZeRO setting keeps the stage); bad files are named."""

import json

import pytest

from domino.config import ConfigError, parse_config
from domino.train.engine import deepspeed_config


def _config(tmp_path, overrides, *flags):
    path = tmp_path / "ds.json"
    path.write_text(overrides if isinstance(overrides, str) else json.dumps(overrides))
    return parse_config(["--preset", "tiny", "--zero-stage", "2", "--clip-grad", "0.5", *flags,
                         "--deepspeed-config", str(path)])


def test_overrides_merge_key_by_key_into_the_derived_config(tmp_path):
    derived = deepspeed_config(parse_config(["--preset", "tiny", "--zero-stage", "2", "--clip-grad", "0.5"]))
    merged = deepspeed_config(_config(tmp_path, {"zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 1e6},
                                                 "gradient_clipping": 2.0, "flops_profiler": {"enabled": False}}))
    assert merged["zero_optimization"] == {**derived["zero_optimization"], "overlap_comm": True,
                                           "reduce_bucket_size": 1e6}
    assert merged["zero_optimization"]["stage"] == 2  # kept: only the named keys changed
    assert merged["gradient_clipping"] == 2.0 and derived["gradient_clipping"] == 0.5
    assert merged["flops_profiler"] == {"enabled": False}
    untouched = {k: v for k, v in derived.items() if k not in ("zero_optimization", "gradient_clipping")}
    assert {k: merged[k] for k in untouched} == untouched


def test_a_scalar_replaces_an_object_and_an_object_replaces_a_scalar(tmp_path):
    merged = deepspeed_config(_config(tmp_path, {"zero_optimization": 0, "steps_per_print": {"odd": 1}}))
    assert merged["zero_optimization"] == 0 and merged["steps_per_print"] == {"odd": 1}


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot read JSON"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_unreadable_or_non_object_files_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=f"--deepspeed-config {tmp_path / 'ds.json'}: {message}"):
        deepspeed_config(_config(tmp_path, text))
