"""The HTML report: self-contained, with embedded plots, the evaluation table, config and samples."""

import base64
import json
from html.parser import HTMLParser

import pytest

from domino.config import ConfigError, DominoConfig
from domino.eval.report import write_report


class _Page(HTMLParser):
    """Collects images, table cells by table id, and every external reference."""

    def __init__(self):
        super().__init__()
        self.images, self.tables, self.external, self.text = {}, {}, [], []
        self._table = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images[attrs.get("id")] = attrs["src"]
        if tag == "table":
            self._table = attrs.get("id")
            self.tables[self._table] = []
        for key in ("src", "href"):
            if key in attrs and not attrs[key].startswith("data:"):
                self.external.append(attrs[key])
        if tag in ("script", "link"):
            self.external.append(tag)

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None

    def handle_data(self, data):
        self.text.append(data)
        if self._table and data.strip():
            self.tables[self._table].append(data.strip())


def _metrics(path, iterations=20, truncated_tail=False):
    lines = []
    for it in range(1, iterations + 1):
        lines.append(json.dumps({"iteration": it, "consumed_samples": 8 * it, "lm_loss": 10.0 / it, "lr": 1e-3,
                                 "grad_norm": 1.0 / it, "loss_scale": 1.0, "iteration_time_s": 0.5,
                                 "tokens_per_s": 1000.0 + it, "tflops_per_device": 0.1, "mfu": 0.01,
                                 "memory_gb": 0.2}))
        if it % 10 == 0:
            lines.append(json.dumps({"eval": "valid", "iteration": it, "lm_loss": 11.0 / it, "ppl": 2.0}))
    text = "\n".join(lines) + "\n"
    if truncated_tail:
        text += '{"iteration": 21, "lm_lo'
    path.write_text(text)
    return path


def test_report_renders_everything(tmp_path):
    config = DominoConfig().replace(hidden_size=96)
    out = write_report(tmp_path / "sub" / "report.html", _metrics(tmp_path / "m.jsonl", truncated_tail=True),
                       eval_results={"loss": 3.25, "ppl": 25.79, "accuracy": 0.31, "tokens": 4096},
                       config=config, samples=[{"prompt": "To be <or>", "completion": " not to be"}])
    page = _Page()
    page.feed(out.read_text())
    assert page.external == []  # self-contained: nothing to fetch
    for name in ("loss", "throughput", "schedule"):
        src = page.images[f"plot-{name}"]
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    evaluation = page.tables["evaluation"]
    assert "3.25" in evaluation and "4,096" in evaluation and "25.79" in evaluation
    assert any(cell.startswith("valid (logged in training, iteration 20)") for cell in evaluation)
    assert "31.0 %" in evaluation
    assert "model.hidden_size" in page.tables["config"] and "96" in page.tables["config"]
    text = "".join(page.text)
    assert "To be <or>" in text and "not to be" in text  # escaped in the HTML, intact once parsed


def test_report_states_what_ran_and_shows_no_empty_or_none_cell(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": it, "lm_loss": 5.0 / it, "lr": 1e-3, "tokens_per_s": 900.0,
                                           "mfu": None, "memory_gb": 0.3}) + "\n" for it in (1, 2, 3))
                       + json.dumps({"eval": "valid", "iteration": 3, "lm_loss": 1.5, "ppl": 4.48}) + "\n")
    config = DominoConfig().replace(lr_warmup_iters=2)  # many optional settings unset (None, empty lists)
    out = write_report(tmp_path / "r.html", metrics, eval_results={"new": {"loss": 1.4, "ppl": 4.06, "accuracy": 0.5,
                                                                           "tokens": 512}},
                       config=config, samples=[{"prompt": "A", "completion": " b"}],
                       run_info=[("layout", "2 processes = tensor parallel 2 x data parallel 1")],
                       notes=["Sampled at temperature 0.8, top-k 40; 9 of 10 words (90%) are words of the corpus."])
    page = _Page()
    page.feed(out.read_text())
    cells = [cell for table in page.tables.values() for cell in table]
    assert "None" not in cells and all(cell.strip() for cell in cells)
    assert page.tables["what-ran"] == ["what", "details", "layout", "2 processes = tensor parallel 2 x data parallel 1"]
    assert "MFU (% of peak)" in page.tables["summary"]
    assert any(cell.startswith("not measured: no reference peak") for cell in page.tables["summary"])
    assert page.tables["evaluation"].count("not logged") == 2  # training logs loss and perplexity only
    assert "train.lr_decay_iters" not in page.tables["config"]  # unset: left out, and the page says so
    assert "temperature 0.8, top-k 40" in "".join(page.text)


def test_report_without_metrics_or_extras(tmp_path):
    out = write_report(tmp_path / "r.html", None)
    page = _Page()
    page.feed(out.read_text())
    assert page.images == {} and "No training metrics to plot." in "".join(page.text)


def test_report_bad_metrics_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        write_report(tmp_path / "r.html", tmp_path / "missing.jsonl")
    assert not (tmp_path / "r.html").exists()


def test_report_skips_and_counts_malformed_metrics_lines(tmp_path, caplog):
    from domino.eval.report_plots import read_metrics

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1, "lm_loss": 5.0}\nnot json\n[1, 2]\n' + "[" * 100000 + "\n"
                   '{"iteration": 2, "lm_loss": 4.0}\n{"eval": "valid", "iteration": 2, "lm_loss": 4.5}\n{"iter')
    train, evals = read_metrics(bad)
    assert [r["iteration"] for r in train] == [1, 2] and len(evals) == 1
    assert "skipped 4 malformed line(s), first line 2: not JSON" in caplog.text
    write_report(tmp_path / "r.html", bad)
    assert (tmp_path / "r.html").exists()


def test_the_report_shows_the_runs_goodput_per_attempt_from_its_ledger(tmp_path):
    """A save root with a goodput ledger (three attempts: killed, SIGTERMed, finished) gets a Goodput section: the
    account's line and one stacked bar per attempt; a root without one gets none."""
    from goodput.test_goodput_accounting import TIMELINE

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "goodput.jsonl").write_text("".join(json.dumps(e) + "\n" for e in TIMELINE))
    page = write_report(tmp_path / "r.html", None, save_root=root).read_text()
    assert "<h2>Goodput</h2>" in page and "goodput 50.8 % of 2.0 min over 3 attempts" in page
    assert 'id="plot-goodput"' in page and "data:image/png;base64," in page
    assert "<h2>Goodput</h2>" not in write_report(tmp_path / "s.html", None, save_root=tmp_path).read_text()
