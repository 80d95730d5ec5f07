"""The `specdec` command line as users script it: `up`, `generate --json`, exit statuses,
SIGTERM, and the tokenizer-mismatch refusal — real processes, tiny models on disk."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.factories import make_tiny_model, make_tiny_tokenizer, save_model_dir
from tests.harness import reference_greedy

STATS_KEYS = {"rounds", "proposed", "accepted", "acceptance_rate", "tokens_per_round", "ttft_s", "tokens_per_s"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def specdec(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tokenizer = make_tiny_tokenizer()
    target = make_tiny_model(tokenizer, seed=0)
    other_tokenizer = make_tiny_tokenizer(vocab_size=300)
    return {
        "target": save_model_dir(root / "target", target, tokenizer),
        "draft": save_model_dir(root / "draft", make_tiny_model(tokenizer, seed=3, layers=1), tokenizer),
        "mismatched": save_model_dir(root / "mismatched", make_tiny_model(other_tokenizer, seed=4), other_tokenizer),
    }


def start_up(*args: str) -> tuple[subprocess.Popen, list[str]]:
    if "--http-port" not in args:
        args = (*args, "--http-port", "0")
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "up", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("coordinator"):
            return proc, lines
    proc.kill()
    raise AssertionError(f"specdec up did not start: {lines} {proc.stderr.read()}")


METRICS_PORT = free_port()


HTTP_PORT = free_port()
SERVED_NAME = "smollm2-135m"  # the name the README's curl examples use


@pytest.fixture(scope="module")
def up(model_dirs):
    port = free_port()
    proc, lines = start_up("--port", str(port), "--target", str(model_dirs["target"]),
                           "--draft", str(model_dirs["draft"]), "--k", "3", "--metrics-port", str(METRICS_PORT),
                           "--http-port", str(HTTP_PORT), "--served-model-name", SERVED_NAME)
    lines.append(proc.stdout.readline())  # the HTTP API's line follows the coordinator's
    yield port, proc, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_up_prints_where_each_service_listens(up):
    port, _, lines = up
    text = "".join(lines)
    assert "target worker" in text and "draft worker" in text
    assert f"coordinator    listening on 127.0.0.1:{port}" in text


def state_and_parent(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def test_a_draft_worker_dies_with_a_killed_up(model_dirs):
    """`specdec up` killed outright (no cleanup of its own) takes its draft worker process
    with it."""
    from tests.conftest import SESSION_MARK, processes_left_behind

    proc, _ = start_up("--port", str(free_port()), "--target", str(model_dirs["target"]),
                       "--draft", str(model_dirs["draft"]))
    children = [int(line.split(":")[0]) for line in processes_left_behind(os.environ[SESSION_MARK])
                if " serve draft " in line]
    children = [pid for pid in children if (state_and_parent(pid) or ("", 0))[1] == proc.pid]
    assert len(children) == 1
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (state_and_parent(children[0]) or ("Z",))[0] != "Z":
        time.sleep(0.2)
    assert (state_and_parent(children[0]) or ("Z",))[0] == "Z", "the draft worker outlived its killed parent"


def test_up_prints_the_http_api_url(up):
    _, _, lines = up
    assert f"HTTP API       (OpenAI-compatible) on http://127.0.0.1:{HTTP_PORT}/v1" in "".join(lines)


def readme_curl_commands() -> list[str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return [line for line in readme.splitlines() if line.startswith("curl ") and "localhost:8000" in line]


def test_the_readme_curl_examples_answer(up):
    commands = readme_curl_commands()
    assert len(commands) == 3
    outputs = []
    for command in commands:
        result = subprocess.run(command.replace("localhost:8000", f"127.0.0.1:{HTTP_PORT}"), shell=True,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    chat, streamed, models = outputs
    assert json.loads(chat)["choices"][0]["message"]["content"]
    assert streamed.rstrip().endswith("data: [DONE]") and '"text_completion"' in streamed
    assert json.loads(models)["data"][0]["id"] == SERVED_NAME


def test_openai_sdk_through_up_equals_generate(up):
    import openai

    port, _, _ = up
    grpc_out = json.loads(specdec("generate", "--addr", f"127.0.0.1:{port}", "--max-new-tokens", "20", "--json",
                                  "The quick brown fox").stdout)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=SERVED_NAME, max_tokens=20, temperature=0,
                                           messages=[{"role": "user", "content": "The quick brown fox"}],
                                           extra_body={"return_token_ids": True})
    assert reply.choices[0].model_extra["token_ids"] == grpc_out["token_ids"]
    assert reply.choices[0].message.content == grpc_out["text"]


def test_generate_json_output_equals_target_alone(up, model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port, _, _ = up
    result = specdec("generate", "--addr", f"127.0.0.1:{port}", "--max-new-tokens", "20", "--json",
                     "The quick brown fox")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) >= {"text", "token_ids", "stats"} and set(out["stats"]) >= STATS_KEYS
    assert out["stats"]["resumes"] == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"])
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"]).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "The quick brown fox"}],
                                           add_generation_prompt=True)["input_ids"]
    assert out["token_ids"] == reference_greedy(model, list(prompt), 20)
    assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_generate_streams_text_to_stdout(up):
    port, _, _ = up
    result = specdec("generate", "--addr", f"127.0.0.1:{port}", "--max-new-tokens", "8", "--raw", "--no-speculation",
                     "hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")


def test_failed_generate_exits_nonzero_with_status_on_stderr(up):
    port, _, _ = up
    result = specdec("generate", "--addr", f"127.0.0.1:{port}", "--max-new-tokens", "0", "hi")
    assert result.returncode != 0
    assert result.stderr.startswith("INVALID_ARGUMENT: max_new_tokens")


def test_generate_without_a_server_says_unavailable():
    result = specdec("generate", "--addr", f"127.0.0.1:{free_port()}", "hi")
    assert result.returncode != 0 and result.stderr.startswith("UNAVAILABLE")


def test_generate_resumes_unless_told_not_to():
    """Without a server every attempt fails UNAVAILABLE: by default generate tries again
    with back-off (the resume path), with --no-resume it gives up at once."""
    timings = {}
    for flag in ([], ["--no-resume"]):
        began = time.perf_counter()
        result = specdec("generate", "--addr", f"127.0.0.1:{free_port()}", *flag, "hi")
        timings[bool(flag)] = time.perf_counter() - began
        assert result.returncode != 0 and result.stderr.startswith("UNAVAILABLE")
    assert timings[False] > timings[True] + 0.3  # five back-offs of up to 0.2 s x 2^n


def test_up_refuses_a_draft_with_another_tokenizer(model_dirs):
    result = specdec("up", "--port", str(free_port()), "--http-port", "0", "--target", str(model_dirs["target"]),
                     "--draft", str(model_dirs["mismatched"]))
    assert result.returncode != 0
    assert "FAILED_PRECONDITION: tokenizer mismatch" in result.stderr


def test_sigterm_stops_up_cleanly(model_dirs):
    proc, _ = start_up("--port", str(free_port()), "--target", str(model_dirs["target"]), "--draft", "ngram",
                       "--grace-period", "2")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_metrics_endpoint_serves_the_autoscaling_metrics(up):
    import re
    import urllib.request

    port, _, _ = up
    result = specdec("generate", "--addr", f"127.0.0.1:{port}", "--max-new-tokens", "5", "--raw", "--json", "count")
    assert result.returncode == 0, result.stderr
    body = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    for name in ("specdec_worker_inflight_requests", "specdec_worker_request_seconds_bucket",
                 "specdec_coordinator_active_requests", "specdec_accepted_length_bucket"):
        assert name in body, name
    generated = float(re.search(r"^specdec_generated_tokens_total (\S+)$", body, re.M).group(1))
    assert generated >= 5


def test_top_shows_the_served_requests(up):
    port, _, _ = up
    assert specdec("generate", "--addr", f"127.0.0.1:{port}", "--max-new-tokens", "5", "--raw", "x").returncode == 0
    result = specdec("top", "--once", "--metrics", f"http://127.0.0.1:{METRICS_PORT}/metrics")
    assert result.returncode == 0, result.stderr
    assert "speculate acceptance" in result.stdout and "target" in result.stdout
    assert "OK " in result.stdout  # requests by status


def test_up_defaults_to_the_head_trained_for_the_target_else_ngram(tmp_path, monkeypatch):
    from specdec import models

    # The committed head for SmolLM2-135M trained within 90 minutes (specdec/drafts/), measured faster
    # than n-gram overall.
    assert models.default_draft("smollm2-135m") == "smollm2-135m-eagle90"
    assert models.default_draft(str(tmp_path / "my-model")) == "ngram"
    monkeypatch.setattr(models, "DRAFTS_DIR", tmp_path)  # an installation without the heads
    assert models.default_draft("smollm2-135m") == "ngram"


WORKER_LINK_FIELDS = ("worker_timeout_s", "worker_retries", "retry_backoff_s", "worker_keepalive_s",
                      "worker_keepalive_timeout_s", "eject_after_failures", "eject_base_s", "eject_max_s",
                      "max_ejected_percent")


@pytest.mark.parametrize("command", [["serve", "coordinator"], ["up"]])
def test_worker_link_flags_and_variables_reach_the_coordinator_config(command, monkeypatch):
    import dataclasses

    from specdec.cli import build_parser, flags
    from specdec.config import CoordinatorConfig

    def config(*argv: str) -> tuple:
        args = build_parser().parse_args([*command, *argv])  # variables are read as the parser is built
        made = flags.coordinator_config(args, "target:1", None, "tokenizer")
        return tuple(getattr(made, name) for name in WORKER_LINK_FIELDS)

    defaults = {f.name: f.default for f in dataclasses.fields(CoordinatorConfig)}
    assert config() == tuple(defaults[name] for name in WORKER_LINK_FIELDS)
    assert config("--worker-timeout-s", "12", "--worker-retries", "2", "--worker-backoff-s", "0.5",
                  "--worker-keepalive-s", "7", "--worker-keepalive-timeout-s", "3", "--eject-after-failures", "4",
                  "--eject-base-s", "10", "--eject-max-s", "120",
                  "--max-ejected-percent", "25") == (12.0, 2, 0.5, 7.0, 3.0, 4, 10.0, 120.0, 25.0)
    for variable, value in (("SPECDEC_WORKER_TIMEOUT_S", "13"), ("SPECDEC_WORKER_RETRIES", "3"),
                            ("SPECDEC_WORKER_BACKOFF_S", "0.3"), ("SPECDEC_WORKER_KEEPALIVE_S", "8"),
                            ("SPECDEC_WORKER_KEEPALIVE_TIMEOUT_S", "4"), ("SPECDEC_EJECT_AFTER_FAILURES", "6"),
                            ("SPECDEC_EJECT_BASE_S", "11"), ("SPECDEC_EJECT_MAX_S", "121"),
                            ("SPECDEC_MAX_EJECTED_PERCENT", "26")):
        monkeypatch.setenv(variable, value)
    assert config() == (13.0, 3, 0.3, 8.0, 4.0, 6, 11.0, 121.0, 26.0)
    assert config("--eject-base-s", "5")[6] == 5.0  # a flag wins over its variable


def test_a_keepalive_workers_would_refuse_stops_the_coordinator_at_start(model_dirs):
    result = specdec("serve", "coordinator", "--port", "0", "--http-port", "0", "--tokenizer",
                     str(model_dirs["target"]), "--target-addr", f"127.0.0.1:{free_port()}",
                     "--worker-keepalive-s", "0.2", timeout=60)
    assert result.returncode == 2
    assert "INVALID_ARGUMENT: --worker-keepalive-s must be 0 (off) or at least 1" in result.stderr
