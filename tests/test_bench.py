"""`specdec bench` end to end on a tiny random model saved as a HF directory: the real CLI,
`specdec up` in its own process, HF generate() and assisted generation in the bench's, one
prompt per kind. Checks the outputs and that every field a reader needs is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdec.speedup import alpha_from_acceptance_rate, leviathan_speedup, observed_theoretical_speedup
from specdec.bench.prompts import KINDS
from tests.factories import make_tiny_model, make_tiny_tokenizer, save_model_dir

CONFIGURATIONS = {"hf_generate", "hf_prompt_lookup", "hf_generate_fastpath", "hf_prompt_lookup_fastpath",
                  "specdec_target_only", "specdec_ngram"}
ROW_FIELDS = {"tokens", "tokens_per_s", "wall_s", "speedup_vs_hf_generate", "speedup_vs_specdec_target_only",
              "outputs_match", "foreign_load_max"}
SPECULATIVE_FIELDS = {"acceptance_rate", "alpha", "tokens_per_round", "rounds", "proposed", "accepted", "c", "v",
                      "theoretical_speedup", "theoretical_speedup_closed_form", "fraction_of_theoretical",
                      "speedup_vs_hf_same_drafter", "speedup_vs_hf_same_drafter_fastpath", "wire_bytes_per_token"}
COST_FIELDS = {"context_tokens", "k", "target_step_s", "verify_s", "v", "ngram_lookup_s", "c_ngram"}
MACHINE_FIELDS = {"cpu_model", "cpu_cores", "torch", "transformers", "torch_threads"}


@pytest.fixture(scope="module")
def bench_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    tokenizer = make_tiny_tokenizer()
    target = save_model_dir(root / "target", make_tiny_model(tokenizer, seed=0, max_positions=1024), tokenizer)
    out = root / "out"
    # The machine may be shared: a load threshold of 1 never repeats a run.
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "bench", "--target", str(target), "--quick", "--max-new-tokens", "12",
         "--threads", "1", "--max-foreign-load", "1", "--no-progress", "--out", str(out), "--name", "tiny"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "tiny.json").read_text()), proc.stdout, out


def test_every_output_equals_hf_generate(bench_report):
    report, stdout, _ = bench_report
    assert report["outputs_match"] == {"all": True, "mismatches": []}
    assert "Every configuration's greedy output equals (1)" in stdout


def test_report_lists_every_configuration(bench_report):
    report, _, _ = bench_report
    assert {c["name"] for c in report["configurations"]} == CONFIGURATIONS


def test_report_describes_the_machine(bench_report):
    report, _, _ = bench_report
    assert MACHINE_FIELDS <= set(report["machine"])


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_report_summarises_every_kind_of_prompt(bench_report, name):
    report, _, _ = bench_report
    assert set(report["summary"][name]) == {*KINDS, "open", "all"}


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_every_per_prompt_row_has_every_field(bench_report, name):
    report, _, _ = bench_report
    for prompt, row in report["per_prompt"][name].items():
        assert ROW_FIELDS <= set(row), (name, prompt)


def test_speculative_rows_have_the_speculation_fields(bench_report):
    report, _, _ = bench_report
    for prompt, row in report["per_prompt"]["specdec_ngram"].items():
        assert SPECULATIVE_FIELDS <= set(row), prompt


def test_report_has_every_measured_cost(bench_report):
    report, _, _ = bench_report
    for measured in report["costs"].values():
        assert COST_FIELDS <= set(measured)


def test_measured_step_costs_are_positive(bench_report):
    report, _, _ = bench_report
    for measured in report["costs"].values():
        assert measured["target_step_s"] > 0 and measured["v"] > 0


def test_report_checks_every_target(bench_report):
    report, _, _ = bench_report
    assert {t["name"] for t in report["targets"]} >= {"grounded_vs_hf_generate", "grounded_vs_hf_prompt_lookup",
                                                      "open_vs_target_only", "fraction_of_theoretical"}


def test_report_has_one_run_per_configuration_per_kind(bench_report):
    report, _, _ = bench_report
    assert len(report["runs"]) == len(CONFIGURATIONS) * len(KINDS)


def test_markdown_table_is_printed(bench_report):
    _, stdout, _ = bench_report
    assert "| # | configuration | kind | tok/s |" in stdout


def test_markdown_report_is_written(bench_report):
    _, _, out = bench_report
    assert (out / "tiny.md").read_text().startswith("# specdec bench")


def test_chart_is_written_as_png(bench_report):
    _, _, out = bench_report
    assert (out / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class TestCostModel:
    def test_leviathan_speedup_limits(self):
        assert leviathan_speedup(0.0, 4, 0.0, 1.0) == 1.0
        assert leviathan_speedup(1.0, 4, 0.0, 1.0) == 5.0
        # The paper's example shape: alpha 0.8, k 4, c 0.05 (v = 1).
        assert leviathan_speedup(0.8, 4, 0.05, 1.0) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))

    def test_alpha_inverts_the_accepted_fraction_of_a_block(self):
        for alpha in (0.1, 0.5, 0.9):
            rate = alpha * (1 - alpha ** 4) / ((1 - alpha) * 4)
            assert alpha_from_acceptance_rate(rate, 4) == pytest.approx(alpha, abs=1e-9)

    def test_observed_form_equals_closed_form_for_expected_rounds(self):
        alpha, k, c, v, rounds = 0.7, 4, 0.01, 1.1, 1000
        generated = rounds * (1 - alpha ** (k + 1)) / (1 - alpha)
        observed = observed_theoretical_speedup(generated, rounds, rounds * k, c, v, k)
        assert observed == pytest.approx(leviathan_speedup(alpha, k, c, v))


def test_bench_runs_a_feature_level_head_through_specdec_up(tmp_path):
    """`specdec bench --draft HEAD_DIR`: `specdec up` loads the head next to the target (and,
    through its config, the target it reads), HF assisted generation is left out (it cannot
    run a head), the outputs equal HF generate(), and the wire cost per token is reported —
    with the head on the target worker, no features cross the wire."""
    import torch

    from specdec import eagle

    tokenizer = make_tiny_tokenizer()
    # Wide enough that features (2 bytes per hidden unit per token) would dwarf the ids and
    # framing a round costs (~130 bytes per token when a random head is rarely accepted).
    model = make_tiny_model(tokenizer, seed=0, hidden=256, max_positions=1024)
    target = save_model_dir(tmp_path / "target", model, tokenizer)
    torch.manual_seed(0)
    vocab = torch.arange(0, model.config.vocab_size, 2)
    eagle.save(eagle.build(eagle.new_config(model, str(target), len(vocab)), model, vocab), tmp_path / "head")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "bench", "--target", str(target), "--draft", str(tmp_path / "head"),
         "--quick", "--max-new-tokens", "12", "--threads", "1", "--max-foreign-load", "1", "--no-progress",
         "--no-fast-peers", "--out", str(out), "--name", "head"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "head.json").read_text())
    names = {c["name"] for c in report["configurations"]}
    assert "specdec_draft" in names and "hf_assisted_draft" not in names
    assert report["outputs_match"]["all"]
    rows = report["per_prompt"]["specdec_draft"].values()
    assert all(row["c"] > 0 for row in rows)
    assert {"draft_open_alpha", "draft_c", "draft_open_vs_target_only"} <= {t["name"] for t in report["targets"]}
    # Features (2 bytes per hidden unit per token) stay on the target worker: ids only.
    assert 0 < max(row["wire_bytes_per_token"] for row in rows) < 2 * model.config.hidden_size
