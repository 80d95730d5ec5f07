"""Prometheus metrics of the three services (DESIGN.md principle 5: measure, don't assume).

The names below are relied on by the Kubernetes autoscalers in k8s/ (worker in-flight
requests) and by dashboards; rename none of them without changing those."""

from __future__ import annotations

import contextlib
import time

from prometheus_client import Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

WORKER_INFLIGHT = Gauge(
    "specdec_worker_inflight_requests",
    "Propose/Verify rounds being served now (queued included; a batched call counts each round)", ["kind"]
)
WORKER_SECONDS = Histogram(
    "specdec_worker_request_seconds", "Propose/Verify latency on the worker, queueing included",
    ["kind", "method"], buckets=LATENCY_BUCKETS,
)
WORKER_CACHE_BYTES = Gauge("specdec_worker_cache_bytes",
                           "Bytes the sessions' caches keep allocated (buffer capacity, a head's state), "
                           "what --max-cache-mb bounds", ["kind"])
WORKER_SESSIONS = Gauge("specdec_worker_sessions", "Sessions whose cache the worker holds", ["kind"])
WORKER_EVICTIONS = Counter("specdec_worker_cache_evictions_total", "Sessions evicted (LRU) to stay in budget",
                           ["kind"])
POSITION_PROPOSED = Counter("specdec_position_proposed_total", "Draft tokens proposed at each block position",
                            ["position"])
POSITION_ACCEPTED = Counter("specdec_position_accepted_total", "Draft tokens accepted at each block position",
                            ["position"])
WORKER_RESYNCS = Counter("specdec_worker_resyncs_total", "Rounds answered with a resync request", ["kind"])
WORKER_SESSIONS_EXPIRED = Counter("specdec_worker_sessions_expired_total",
                                  "Sessions freed after --session-ttl seconds without a round", ["kind"])
WORKER_STALLED = Gauge("specdec_worker_model_stalled",
                       "1 while the model thread has work but finished no step for --stall-timeout seconds "
                       "(health NOT_SERVING)", ["kind"])
WORKER_STALLS = Counter("specdec_worker_model_stalls_total", "Times the model thread was found stalled", ["kind"])
COORDINATOR_ACTIVE = Gauge("specdec_coordinator_active_requests", "Generate streams being served now")
REQUESTS = Counter("specdec_coordinator_requests_total", "Generate requests by final status", ["status"])
GENERATED_TOKENS = Counter("specdec_generated_tokens_total", "Tokens streamed to clients")
ROUNDS = Counter("specdec_rounds_total", "Speculative rounds (one Verify each)")
PROPOSED = Counter("specdec_proposed_tokens_total", "Draft tokens proposed")
ACCEPTED = Counter("specdec_accepted_tokens_total", "Draft tokens accepted by the target")
ALTERNATIVE_TOKENS = Counter("specdec_alternative_tokens_total",
                             "Tokens committed from a head's alternatives (the chosen alternative and the "
                             "target's token after it)")
ACCEPTED_LENGTH = Histogram(
    "specdec_accepted_length", "Tokens committed per round (accepted drafts + the target's own)",
    buckets=tuple(range(1, 18)),
)
WORKER_BATCH_ROUNDS = Histogram("specdec_worker_batch_rounds", "Sessions' rounds per batched worker step", ["kind"],
                                buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64))
WORKER_BATCH_ROWS = Histogram("specdec_worker_batch_rows", "Tokens run through the model per batched step", ["kind"],
                              buckets=(1, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
REPLICAS_REFUSED = Counter("specdec_replicas_refused_total",
                           "Worker replicas the coordinator refused to admit (never given a round), by why: "
                           "vocabulary, shape, features, weights, head_weights", ["role", "reason"])
COORDINATOR_QUEUED = Gauge("specdec_coordinator_queued_rounds", "Rounds waiting for the next worker step", ["kind"])
REPLICA_EJECTIONS = Counter("specdec_replica_ejections_total",
                            "Worker replicas ejected after consecutive failed calls (outlier ejection)", ["role"])
REPLICAS_EJECTED = Gauge("specdec_replicas_ejected", "Worker replicas ejected now (outlier ejection)", ["role"])
HEDGED_ROUNDS = Counter("specdec_hedged_rounds_total",
                        "Target rounds also sent to a second replica after going unanswered past the hedge delay, "
                        "by whose answer was used: won (the hedge's) or lost (the first call's)", ["outcome"])
HEDGES_SKIPPED = Counter("specdec_hedges_skipped_total",
                         "Target rounds unanswered past the hedge delay but not hedged, by why: budget, deadline, "
                         "no_replica", ["reason"])
DRAFT_PAUSES = Counter("specdec_draft_pauses_total",
                       "Pauses of drafting on a target replica, so that its step cost model sees steps without drafts")
DRAFT_PRICE_VERDICTS = Counter("specdec_draft_price_verdicts_total",
                               "Pauses of drafting whose tokens per second of step judged the price of a draft row "
                               "(raised: drafting delivered less than not drafting; lowered: more by a margin; kept)",
                               ["verdict"])
ROUNDS_RUN_AHEAD = Counter("specdec_rounds_run_ahead_total",
                           "Rounds a target replica ran by itself, ahead of the coordinator (--run-ahead), "
                           "whose verdicts the coordinator committed")
BUSY_ROUNDS = Counter("specdec_busy_rounds_total",
                      "Rounds a worker replica was too full for (RESOURCE_EXHAUSTED: its KV pool or session "
                      "slots), by what the session did: moved (to another replica), retried (there, after "
                      "the back-off: a target round) or skipped (a draft round: the target decodes it alone)",
                      ["kind", "outcome"])
TTFT = Histogram("specdec_ttft_seconds", "Time from request to first token", buckets=LATENCY_BUCKETS)


# --- the names vLLM exposes -----------------------------------------------------------
# Beside specdec_*, the coordinator counts the same events under the names vLLM's
# OpenAI-compatible server exposes (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/
# metrics.py), labelled as vLLM labels them (model_name, engine), so a dashboard built for
# vLLM reads specdec unchanged. docs/operations.md lists the mapping.

VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE = "0"
VLLM_FINISHED_REASONS = {1: "stop", 2: "length", 3: "stop"}  # FinishReason EOS, LENGTH, STOP


class VllmMetrics:
    """The vLLM-named series, bound to the served model's name by `bind` (the coordinator
    does so once it knows its target); until then every update is dropped."""

    def __init__(self):
        self.families = {
            "running": Gauge("vllm:num_requests_running", "Requests being generated now", VLLM_LABELS),
            "prompt_tokens": Counter("vllm:prompt_tokens", "Prefill tokens processed", VLLM_LABELS),
            "generation_tokens": Counter("vllm:generation_tokens", "Generation tokens processed", VLLM_LABELS),
            "ttft": Histogram("vllm:time_to_first_token_seconds", "Time to first token", VLLM_LABELS,
                              buckets=LATENCY_BUCKETS),
            "e2e": Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", VLLM_LABELS,
                             buckets=LATENCY_BUCKETS),
            "success": Counter("vllm:request_success", "Finished requests by finish reason",
                               (*VLLM_LABELS, "finished_reason")),
            "drafts": Counter("vllm:spec_decode_num_drafts", "Rounds that verified a draft", VLLM_LABELS),
            "draft_tokens": Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", VLLM_LABELS),
            "accepted_tokens": Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       VLLM_LABELS),
            "accepted_per_pos": Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each block position", (*VLLM_LABELS, "position")),
        }
        self.model_name: str | None = None
        self._children: dict[str, object] = {name: _Dropped() for name in self.families}

    def bind(self, model_name: str) -> None:
        self.model_name = model_name
        self._children.update({name: family.labels(model_name, VLLM_ENGINE) for name, family in self.families.items()
                               if name not in ("success", "accepted_per_pos")})

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_children"][name]
        except KeyError:
            raise AttributeError(name) from None

    def finished(self, finish_reason: int, seconds: float) -> None:
        if self.model_name is not None:
            reason = VLLM_FINISHED_REASONS.get(finish_reason, "abort")
            self.families["success"].labels(self.model_name, VLLM_ENGINE, reason).inc()
            self.e2e.observe(seconds)

    def round(self, proposed: int, accepted: int) -> None:
        """One verified round: a draft of `proposed` tokens of which `accepted` were kept."""
        if self.model_name is None or proposed == 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(proposed)
        self.accepted_tokens.inc(accepted)
        for position in range(accepted):
            self.families["accepted_per_pos"].labels(self.model_name, VLLM_ENGINE, str(position)).inc()


class _Dropped:
    """A metric child before binding: accepts every update and records nothing."""

    def inc(self, *_):
        pass

    def dec(self, *_):
        pass

    def observe(self, *_):
        pass


vllm = VllmMetrics()


def observe_store(kind: str, store, evictions_before: int) -> None:
    """Cache gauges after a worker call; counts the evictions the call caused."""
    WORKER_CACHE_BYTES.labels(kind).set(store.cache_bytes())
    WORKER_SESSIONS.labels(kind).set(len(store))
    if store.evictions > evictions_before:
        WORKER_EVICTIONS.labels(kind).inc(store.evictions - evictions_before)


def observe_batch(kind: str, rounds: int, rows: int | None = None) -> None:
    WORKER_BATCH_ROUNDS.labels(kind).observe(rounds)
    if rows is not None:
        WORKER_BATCH_ROWS.labels(kind).observe(rows)


def observe_round(proposed: int, accepted: int) -> None:
    for position in range(proposed):
        POSITION_PROPOSED.labels(str(position)).inc()
        if position < accepted:
            POSITION_ACCEPTED.labels(str(position)).inc()


@contextlib.contextmanager
def worker_call(kind: str, method: str, rounds: int = 1):
    """Counts a worker call's rounds as in flight and times the call."""
    WORKER_INFLIGHT.labels(kind).inc(rounds)
    began = time.perf_counter()
    try:
        yield
    finally:
        WORKER_INFLIGHT.labels(kind).dec(rounds)
        WORKER_SECONDS.labels(kind, method).observe(time.perf_counter() - began)


def serve_metrics(port: int | None, host: str = "0.0.0.0") -> None:
    """Starts the /metrics HTTP endpoint (once per process) when a port is given."""
    if port is not None:
        start_http_server(port, addr=host)
