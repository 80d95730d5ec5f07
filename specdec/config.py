"""Typed configuration of the three services, built from CLI flags (and the environment
variables named on each flag) in specdec.cli — the one place that reads them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from specdec.errors import FailedPrecondition
from specdec.security.tls import ClientTLS, ServerTLS

DEFAULT_COORDINATOR_PORT = 50051
DEFAULT_TARGET_PORT = 50052
DEFAULT_DRAFT_PORT = 50053
DEFAULT_K = 4
MAX_K = 16
# --dtype: the weights' element type (specdec.runtime.precision); "auto": bfloat16 on CUDA,
# float32 elsewhere. Logits are float32 whatever it is.
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHES = ("auto", "paged", "buffered")


@dataclass
class ServerConfig:
    """Where and how a gRPC server listens."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in a pod."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    grace_period_s: float = 20.0
    """On SIGTERM: seconds in-flight calls get to finish after health goes NOT_SERVING."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest gRPC message accepted or sent."""
    metrics_port: int | None = None
    """Port of the Prometheus /metrics endpoint; None: no endpoint."""
    health_port: int | None = None
    """Port of a second, plaintext listener serving only the standard health service (the
    same statuses), for probes that cannot speak TLS (the kubelet's); None: none; 0: a free
    port."""
    tls: ServerTLS = field(default_factory=ServerTLS)
    """Certificate and key (TLS), and the client CA (mutual TLS); unset: plaintext."""
    insecure: bool = False
    """Plaintext off loopback, asked for explicitly (logged as a warning)."""


@dataclass
class WorkerConfig:
    """A draft or target worker."""

    model: str
    """Model spec: HF directory, .gguf file, built-in name, or 'ngram' (draft only)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    max_sessions: int = 256
    """Sessions whose cache is held at once; the least recently used is evicted beyond."""
    max_cache_bytes: int = 2 << 30
    """KV-cache bytes held over all sessions; least recently used sessions are evicted
    beyond it (an evicted session is rebuilt from the coordinator's tokens, not lost)."""
    max_k: int = MAX_K
    """Most draft tokens per round."""
    device: str = "cpu"
    """Torch device for the model."""
    dtype: str = "auto"
    """Element type of the weights loaded by spec (model, draft model, head), one of DTYPES;
    "auto": bfloat16 on CUDA, float32 elsewhere. A model handed to the worker in memory is
    served as it is. Logits are float32 either way (specdec.runtime.precision)."""
    max_batch_rounds: int = 64
    """Most rounds (sessions) one VerifyBatch / ProposeBatch call may carry."""
    cpu_fast_path: bool = True
    """On CPU, serve a copy of the model with oneDNN-packed linears, grouped-query attention
    inside SDPA and buffered KV caches (specdec.runtime.cpu); a feature-level head gets, per
    linear and row count, the kernel timed fastest at load (stock fp32, packed fp32 or packed
    bfloat16: specdec.eagle.fast_cpu_head); no effect on other devices."""
    head: str | None = None
    """Target only: a feature-level draft head (directory or built-in name) to run next to
    the target, drafting in the same step as each verification (target_worker.head)."""
    min_chain_prob: float = 0.15
    """A feature-level head stops its chain before the token that would bring its own
    probability of the whole chain being right below this (0: always draft what is asked;
    specdec.eagle.policy)."""
    min_alt_prob: float = 0.05
    """Target only: a head next to the target also proposes its second choice at a depth of
    its chain where its probability of being right is at least this, scored as a tree leaf
    in the same verification pass (target_worker.verify); 1 or more: never."""
    session_ttl_s: float = 300.0
    """A session no round has touched for this many seconds is freed (its coordinator is
    most likely gone); a later round of it resyncs as after an eviction. 0: never."""
    stall_timeout_s: float = 30.0
    """Health goes NOT_SERVING, and model calls are refused UNAVAILABLE, while the model
    thread has work and finishes no step for this many seconds; SERVING again once a step
    finishes. 0: no watchdog."""
    kv_cache: str = "auto"
    """The KV cache, one of KV_CACHES: "paged" (one pool of fixed-size blocks for every
    session, one forward per step, prefix caching: specdec.runtime.paged_lm), "buffered" (a
    cache per session: specdec.runtime.lm), "auto" (paged on CUDA, buffered elsewhere)."""
    kv_memory_fraction: float = 0.9
    """On CUDA, the share of the memory free after loading the weights that the paged pool
    takes; on CPU the pool is max_cache_bytes."""
    kv_block_size: int = 16
    """Tokens per block of the paged pool."""
    cuda_graphs: bool = False
    """Chain steps of the paged pool, and an inline head's steps, replay CUDA graphs captured at
    padded token counts (specdec.runtime.graphs): on CUDA, where the attention is the Triton
    kernel (the target worker's); elsewhere the log says why not and steps run eagerly."""


@dataclass
class CoordinatorConfig:
    """The client-facing coordinator."""

    target_addr: str
    """Target worker endpoints: comma-separated host:port, a host may be a DNS name that
    resolves to many replicas (a headless Service)."""
    draft_addr: str | None
    """Draft worker endpoints, the same way; None: target-only decoding."""
    tokenizer: str
    """Model spec whose tokenizer renders prompts and detokenizes (the target's)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    default_k: int = DEFAULT_K
    """Speculative tokens per round when a request does not say."""
    max_k: int = MAX_K
    """Largest k a request may ask for."""
    worker_tls: ClientTLS | None = None
    """How to reach TLS workers: their CA, and this coordinator's client cert (mTLS)."""
    target_tls_server_name: str | None = None
    """The name every target replica's certificate must cover, whatever address it is dialed
    at (replicas behind a headless Service are dialed by pod IP); None: the address dialed."""
    draft_tls_server_name: str | None = None
    """The same for the draft replicas."""
    auth_token_file: Path | None = None
    """File of accepted bearer tokens, one per line, re-read when it changes; None (and no
    SPECDEC_AUTH_TOKENS): no authentication."""
    auth_tokens_env: str = ""
    """Comma-separated accepted tokens from the environment (SPECDEC_AUTH_TOKENS)."""
    max_prompt_tokens: int = 32768
    """Longest prompt accepted, in tokens (the model's context may be shorter)."""
    max_concurrent_requests: int = 256
    """Generate streams served at once; beyond: RESOURCE_EXHAUSTED with a retry hint."""
    max_streams_per_client: int = 16
    """Generate streams one client (its token, else its address) may hold at once."""
    rate_limit_per_client: float = 0.0
    """Requests per second one client may start (0: no limit; the CLI's default is 50);
    beyond it a request waits up to rate_limit_wait_s, then gets RESOURCE_EXHAUSTED with a
    retry hint."""
    rate_limit_wait_s: float = 0.5
    """How long a request may queue for its client's rate limit."""
    max_new_tokens_limit: int = 4096
    """Largest max_new_tokens a request may ask for."""
    max_stop_strings: int = 16
    """Most stop strings per request."""
    max_stop_string_chars: int = 256
    """Longest stop string, in characters."""
    worker_timeout_s: float = 60.0
    """Deadline of one Propose or Verify call."""
    worker_retries: int = 5
    """Attempts at a round's worker call before the request fails UNAVAILABLE."""
    retry_backoff_s: float = 0.2
    """First back-off between attempts; doubles each time."""
    resolve_interval_s: float = 5.0
    """How often endpoint names are re-resolved, so replicas that come and go are seen."""
    health_interval_s: float = 1.0
    """How often every replica's health service is polled."""
    worker_keepalive_s: float = 10.0
    """The worker channels ping a worker after this long without hearing from it (gRPC
    keepalive, at least 1 s); 0: no keepalive pings."""
    worker_keepalive_timeout_s: float = 5.0
    """A ping unanswered this long closes the connection and fails its calls UNAVAILABLE, so
    a silent partition ends a call within keepalive + this, not at worker_timeout_s."""
    eject_after_failures: int = 5
    """A replica taken out this many times in a row, with no successful round between, is
    ejected (outlier ejection, coordinator.pool.EjectionPolicy); 0: never."""
    eject_base_s: float = 30.0
    """The first ejection's length; the n-th lasts n times this."""
    eject_max_s: float = 300.0
    """The longest ejection."""
    max_ejected_percent: float = 50.0
    """Most replicas of a kind ejected at once, in percent; the last serving one never is."""
    hedge_percentile: float = 0.0
    """A target round unanswered past this percentile of the pool's recent round latencies
    (times hedge_factor, at least hedge_min_s) also goes to a second replica, and the first
    answer wins (coordinator.hedging); 0: no hedging."""
    hedge_factor: float = 1.0
    """The hedge delay is the percentile times this."""
    hedge_min_s: float = 0.05
    """The shortest hedge delay, in seconds."""
    hedge_max_share: float = 0.1
    """Most target calls hedged, as a share of the pool's recent calls."""
    batching: bool = True
    """Continuous batching: rounds of many requests go to a worker as one batched step
    (coordinator.scheduler); False: one call per round."""
    worker_streams: bool = True
    """With batching: a replica's steps go over one long-lived stream to it (VerifyStream /
    ProposeStream, coordinator.step_stream); False: one unary call per step."""
    step_token_budget: int = 512
    """Tokens (uncached committed + drafts) one step carries, about (one larger round goes alone)."""
    max_batch_rounds: int = 32
    """Most rounds in one step (workers accept 64 by default)."""
    prefill_chunk_tokens: int = 256
    """Longest run of prompt tokens one step prefills, so a long prompt never stalls the others."""
    run_ahead_rounds: int = 8
    """With worker streams: rounds a target replica may run by itself after a round that
    needs nothing but the target (drafted by a head on it, or no drafts), answering each
    on the stream; 0: every round is sent by the coordinator (target_worker.run_ahead)."""
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP API (coordinator.openai_api), on the gRPC server's
    host, TLS and tokens; None: no HTTP API; 0: a free port (the CLI's 0 means None)."""
    served_model_name: str | None = None
    """The model name the HTTP API answers to and lists; None: the target worker's model spec."""

    def worker_channel_tls(self, kind: str) -> ClientTLS | None:
        """worker_tls for the `kind` ("target" or "draft") replicas, with the name their
        certificates are checked against; FailedPrecondition for a name without worker TLS."""
        name = self.target_tls_server_name if kind == "target" else self.draft_tls_server_name
        if not name:
            return self.worker_tls
        if self.worker_tls is None or not self.worker_tls.enabled:
            raise FailedPrecondition(f"--{kind}-tls-server-name {name} needs TLS to the workers: give --worker-ca")
        return replace(self.worker_tls, server_name=name)
