"""The flags every service shares, read with the environment into the typed configs
(specdec.config): the one place that reads SPECDEC_* variables for serving."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from specdec.config import DTYPES, KV_CACHES, CoordinatorConfig, ServerConfig, WorkerConfig
from specdec.security.tls import ServerTLS

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "ngram"
NO_DRAFT = "none"


def env(name: str, default):
    return os.environ.get(name, default)


def seconds(value: str) -> float:
    """A duration flag: a number of seconds, 0 or more."""
    try:
        parsed = float(value)
    except ValueError:
        parsed = -1.0
    if not parsed >= 0 or parsed == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds (0 or more)")
    return parsed


def count(value: str) -> int:
    """A flag counting things: an integer, 0 or more."""
    try:
        parsed = int(value)
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a count (an integer, 0 or more)")
    return parsed


def dtype_name(value: str) -> str:
    """A --dtype flag (or SPECDEC_DTYPE, which argparse passes through here unchecked by
    `choices`): one of DTYPES."""
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"{value!r} is not a dtype: choose from {', '.join(DTYPES)}")
    return value


def add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default=env("SPECDEC_HOST", "127.0.0.1"),
                        help="interface to bind (0.0.0.0 in a pod) [SPECDEC_HOST]")
    parser.add_argument("--port", type=int, default=int(env("SPECDEC_PORT", default_port)),
                        help="gRPC port; 0 picks a free one [SPECDEC_PORT]")
    parser.add_argument("--metrics-port", type=int, default=env("SPECDEC_METRICS_PORT", None),
                        help="serve Prometheus /metrics on this port [SPECDEC_METRICS_PORT]")
    parser.add_argument("--health-port", type=int, default=env("SPECDEC_HEALTH_PORT", None),
                        help="also serve the standard gRPC health service alone, in plaintext, on this port: for "
                             "probes that cannot speak TLS, such as the kubelet's [SPECDEC_HEALTH_PORT]")
    parser.add_argument("--grace-period", type=float, default=float(env("SPECDEC_GRACE_PERIOD", 20.0)),
                        help="seconds in-flight calls get to finish after SIGTERM [SPECDEC_GRACE_PERIOD]")
    parser.add_argument("--tls-cert", default=env("SPECDEC_TLS_CERT", None),
                        help="serve TLS with this certificate (PEM) [SPECDEC_TLS_CERT]")
    parser.add_argument("--tls-key", default=env("SPECDEC_TLS_KEY", None),
                        help="private key of --tls-cert (PEM) [SPECDEC_TLS_KEY]")
    parser.add_argument("--tls-client-ca", default=env("SPECDEC_TLS_CLIENT_CA", None),
                        help="demand client certificates signed by this CA: mutual TLS [SPECDEC_TLS_CLIENT_CA]")
    parser.add_argument("--insecure", action="store_true", default=env("SPECDEC_INSECURE", "") == "1",
                        help="allow plaintext gRPC off loopback (logged as a warning) [SPECDEC_INSECURE=1]")
    parser.add_argument("--log-format", choices=["json", "text"], default=env("SPECDEC_LOG_FORMAT", None),
                        help="log lines as JSON objects (default for serve) or text [SPECDEC_LOG_FORMAT]")


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-sessions", type=int, default=256, help="sessions cached at once (LRU beyond)")
    parser.add_argument("--max-cache-mb", type=int, default=2048, help="MiB the caches may keep allocated (LRU beyond)")
    parser.add_argument("--device", default=env("SPECDEC_DEVICE", "cpu"), help="torch device [SPECDEC_DEVICE]")
    parser.add_argument("--dtype", type=dtype_name, choices=DTYPES, default=env("SPECDEC_DTYPE", "auto"),
                        help="element type of the weights (target, draft model, head); auto: bfloat16 on CUDA, "
                             "float32 elsewhere; logits are float32 whatever it is (default %(default)s) "
                             "[SPECDEC_DTYPE]")
    parser.add_argument("--kv-cache", choices=KV_CACHES, default=env("SPECDEC_KV_CACHE", "auto"),
                        help="paged: one block pool for every session, one forward per step, prefix caching; "
                             "buffered: a cache per session (the CPU fast path); auto: paged on CUDA, buffered "
                             "elsewhere (default %(default)s) [SPECDEC_KV_CACHE]")
    parser.add_argument("--kv-memory-fraction", type=float, default=float(env("SPECDEC_KV_MEMORY_FRACTION", 0.9)),
                        help="on CUDA, the share of the memory left after the weights that the paged pool takes "
                             "(default %(default)s); on CPU the pool is --max-cache-mb [SPECDEC_KV_MEMORY_FRACTION]")
    parser.add_argument("--kv-block-size", type=int, default=int(env("SPECDEC_KV_BLOCK_SIZE", 16)),
                        help="tokens per block of the paged pool (default %(default)s) [SPECDEC_KV_BLOCK_SIZE]")
    parser.add_argument("--cuda-graphs", action="store_true", default=env("SPECDEC_CUDA_GRAPHS", "") == "1",
                        help="with the paged pool on CUDA, replay each decoding or verification step from a CUDA "
                             "graph captured at its padded size (the target worker and its --head's drafting steps; a "
                             "draft model attends through torch and runs eagerly) [SPECDEC_CUDA_GRAPHS=1]")
    parser.add_argument("--min-chain-prob", type=float, default=float(env("SPECDEC_MIN_CHAIN_PROB", 0.15)),
                        help="a feature-level head's chain stops where its own probability of the whole chain "
                             "falls below this; 0: always draft k (default %(default)s) [SPECDEC_MIN_CHAIN_PROB]")
    parser.add_argument("--min-alt-prob", type=float, default=float(env("SPECDEC_MIN_ALT_PROB", 0.05)),
                        help="a head on the target worker also proposes its second choice at a chain depth where "
                             "its probability of being right is at least this, verified as a tree leaf in the same "
                             "pass; 1: never (default %(default)s) [SPECDEC_MIN_ALT_PROB]")
    parser.add_argument("--session-ttl", type=seconds, default=env("SPECDEC_SESSION_TTL", "300"),
                        help="free a session no round has touched for this many seconds (its coordinator is gone; "
                             "a later round resyncs); 0: never (default %(default)s) [SPECDEC_SESSION_TTL]")
    parser.add_argument("--stall-timeout", type=seconds, default=env("SPECDEC_STALL_TIMEOUT", "30"),
                        help="report NOT_SERVING (and refuse calls) while the model thread has work but finishes no "
                             "step for this many seconds; 0: off (default %(default)s) [SPECDEC_STALL_TIMEOUT]")


def server_config(args) -> ServerConfig:
    metrics_port = None if args.metrics_port in (None, "") else int(args.metrics_port)
    health_port = None if args.health_port in (None, "") else int(args.health_port)
    paths = [None if p is None else Path(p) for p in (args.tls_cert, args.tls_key, args.tls_client_ca)]
    return ServerConfig(host=args.host, port=args.port, grace_period_s=args.grace_period, metrics_port=metrics_port,
                        health_port=health_port, tls=ServerTLS(*paths), insecure=args.insecure)


DEFAULT_HTTP_PORT = 8000
# Requests per second one client may start by default: far above what one user's
# completions need, low enough that a runaway client cannot flood the coordinator alone.
DEFAULT_RATE_LIMIT = 50.0


def add_coordinator_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http-port", type=int, default=int(env("SPECDEC_HTTP_PORT", DEFAULT_HTTP_PORT)),
                        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                             "/v1/models, /health) on this port of --host; 0: no HTTP API (default %(default)s) "
                             "[SPECDEC_HTTP_PORT]")
    parser.add_argument("--served-model-name", default=env("SPECDEC_SERVED_MODEL_NAME", None),
                        help="the model name the HTTP API answers to (default: the target's model spec) "
                             "[SPECDEC_SERVED_MODEL_NAME]")
    parser.add_argument("--auth-token-file", default=env("SPECDEC_AUTH_TOKEN_FILE", None),
                        help="require a bearer token from this file (one per line; re-read when it changes) "
                             "[SPECDEC_AUTH_TOKEN_FILE; tokens may also come from SPECDEC_AUTH_TOKENS]")
    parser.add_argument("--max-concurrent-requests", type=int, default=256,
                        help="streams served at once; beyond: RESOURCE_EXHAUSTED")
    parser.add_argument("--max-streams-per-client", type=int, default=16,
                        help="streams one client (token, else address) may hold at once")
    parser.add_argument("--max-prompt-tokens", type=int, default=32768, help="longest prompt accepted")
    parser.add_argument("--rate-limit", type=float, default=float(env("SPECDEC_RATE_LIMIT", DEFAULT_RATE_LIMIT)),
                        help="requests per second one client (its token when tokens are checked, else its address) "
                             "may start; 0: no limit (default %(default)s) [SPECDEC_RATE_LIMIT]")
    parser.add_argument("--max-new-tokens-limit", type=int, default=4096, help="largest max_new_tokens accepted")
    parser.add_argument("--no-batching", action="store_true",
                        help="one worker call per round instead of batched steps (continuous batching off)")
    parser.add_argument("--no-worker-streams", action="store_true",
                        help="send each batched step as a unary call instead of a message on one long-lived "
                             "stream per worker replica")
    parser.add_argument("--step-token-budget", type=int, default=512,
                        help="tokens (uncached committed + drafts) one batched step carries, about")
    parser.add_argument("--max-batch-rounds", type=int, default=32, help="most requests' rounds in one step")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="longest piece of a prompt one step prefills (bounds others' latency)")
    parser.add_argument("--run-ahead", type=count, default=env("SPECDEC_RUN_AHEAD", "8"),
                        help="rounds a target replica may run by itself after one that needs nothing but the target "
                             "(a head on it, or no speculation), streaming each verdict; 0: the coordinator sends "
                             "every round (default %(default)s) [SPECDEC_RUN_AHEAD]")
    parser.add_argument("--worker-timeout-s", type=seconds, default=env("SPECDEC_WORKER_TIMEOUT_S", "60"),
                        help="deadline of one worker call (a draft's is at most 10 s) (default %(default)s) "
                             "[SPECDEC_WORKER_TIMEOUT_S]")
    parser.add_argument("--worker-retries", type=int, default=env("SPECDEC_WORKER_RETRIES", "5"),
                        help="retries of a round's worker call, on another replica when there is one, before the "
                             "request fails UNAVAILABLE (default %(default)s) [SPECDEC_WORKER_RETRIES]")
    parser.add_argument("--resolve-interval-s", type=seconds, default=env("SPECDEC_RESOLVE_INTERVAL_S", "5"),
                        help="re-resolve --target-addr/--draft-addr names this often, so replicas that come and go "
                             "are seen (default %(default)s) [SPECDEC_RESOLVE_INTERVAL_S]")
    parser.add_argument("--worker-backoff-s", type=seconds, default=env("SPECDEC_WORKER_BACKOFF_S", "0.2"),
                        help="first back-off between a round's attempts, doubling after each (default %(default)s) "
                             "[SPECDEC_WORKER_BACKOFF_S]")
    parser.add_argument("--worker-keepalive-s", type=seconds, default=env("SPECDEC_WORKER_KEEPALIVE_S", "10"),
                        help="ping a worker after this long without hearing from it, at least 1; 0: no pings "
                             "(default %(default)s) [SPECDEC_WORKER_KEEPALIVE_S]")
    parser.add_argument("--worker-keepalive-timeout-s", type=seconds,
                        default=env("SPECDEC_WORKER_KEEPALIVE_TIMEOUT_S", "5"),
                        help="a ping unanswered this long drops the connection and fails its calls, which retry "
                             "elsewhere (default %(default)s) [SPECDEC_WORKER_KEEPALIVE_TIMEOUT_S]")
    parser.add_argument("--eject-after-failures", type=int, default=env("SPECDEC_EJECT_AFTER_FAILURES", "5"),
                        help="eject a worker replica that fails this many calls in a row (outlier ejection); "
                             "0: never (default %(default)s) [SPECDEC_EJECT_AFTER_FAILURES]")
    parser.add_argument("--eject-base-s", type=seconds, default=env("SPECDEC_EJECT_BASE_S", "30"),
                        help="a replica's n-th ejection lasts n times this (default %(default)s) "
                             "[SPECDEC_EJECT_BASE_S]")
    parser.add_argument("--eject-max-s", type=seconds, default=env("SPECDEC_EJECT_MAX_S", "300"),
                        help="the longest ejection (default %(default)s) [SPECDEC_EJECT_MAX_S]")
    parser.add_argument("--max-ejected-percent", type=float, default=env("SPECDEC_MAX_EJECTED_PERCENT", "50"),
                        help="most replicas of a kind ejected at once, in percent; the last serving one never is "
                             "(default %(default)s) [SPECDEC_MAX_EJECTED_PERCENT]")
    parser.add_argument("--hedge-percentile", type=float, default=env("SPECDEC_HEDGE_PERCENTILE", "0"),
                        help="hedge a target round unanswered past this percentile of the recent round latencies "
                             "(times --hedge-factor): send it to a second replica too, the first answer wins; "
                             "e.g. 95; 0: off (default %(default)s) [SPECDEC_HEDGE_PERCENTILE]")
    parser.add_argument("--hedge-factor", type=float, default=env("SPECDEC_HEDGE_FACTOR", "1"),
                        help="the hedge delay is the percentile times this (default %(default)s) "
                             "[SPECDEC_HEDGE_FACTOR]")
    parser.add_argument("--hedge-min-s", type=seconds, default=env("SPECDEC_HEDGE_MIN_S", "0.05"),
                        help="the shortest hedge delay (default %(default)s) [SPECDEC_HEDGE_MIN_S]")
    parser.add_argument("--hedge-max-share", type=float, default=env("SPECDEC_HEDGE_MAX_SHARE", "0.1"),
                        help="most target calls hedged, as a share of the recent ones (default %(default)s) "
                             "[SPECDEC_HEDGE_MAX_SHARE]")


def coordinator_config(args, target_addr: str, draft_addr: str | None, tokenizer: str, worker_tls=None):
    return CoordinatorConfig(
        target_addr=target_addr, draft_addr=draft_addr, tokenizer=tokenizer, server=server_config(args),
        default_k=args.k, worker_tls=worker_tls,
        auth_token_file=Path(args.auth_token_file) if args.auth_token_file else None,
        auth_tokens_env=os.environ.get("SPECDEC_AUTH_TOKENS", ""),
        max_concurrent_requests=args.max_concurrent_requests, max_streams_per_client=args.max_streams_per_client,
        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
        rate_limit_per_client=args.rate_limit, batching=not args.no_batching,
        worker_streams=not args.no_worker_streams,
        step_token_budget=args.step_token_budget, max_batch_rounds=args.max_batch_rounds,
        prefill_chunk_tokens=args.prefill_chunk, run_ahead_rounds=args.run_ahead, http_port=args.http_port or None,
        served_model_name=args.served_model_name,
        worker_timeout_s=args.worker_timeout_s, worker_retries=args.worker_retries,
        retry_backoff_s=args.worker_backoff_s, worker_keepalive_s=args.worker_keepalive_s,
        worker_keepalive_timeout_s=args.worker_keepalive_timeout_s, eject_after_failures=args.eject_after_failures,
        eject_base_s=args.eject_base_s, eject_max_s=args.eject_max_s, max_ejected_percent=args.max_ejected_percent,
        hedge_percentile=args.hedge_percentile, hedge_factor=args.hedge_factor, hedge_min_s=args.hedge_min_s,
        hedge_max_share=args.hedge_max_share, resolve_interval_s=max(args.resolve_interval_s, 0.1),
    )


def worker_config(args, model: str, port: int | None = None) -> WorkerConfig:
    server = server_config(args)
    if port is not None:
        server.port = port
    return WorkerConfig(model=model, server=server, max_sessions=args.max_sessions,
                        max_cache_bytes=args.max_cache_mb << 20, device=args.device, dtype=args.dtype,
                        min_chain_prob=args.min_chain_prob, min_alt_prob=args.min_alt_prob,
                        head=getattr(args, "head", None), session_ttl_s=args.session_ttl,
                        stall_timeout_s=args.stall_timeout, kv_cache=args.kv_cache,
                        kv_memory_fraction=args.kv_memory_fraction, kv_block_size=args.kv_block_size,
                        cuda_graphs=args.cuda_graphs)
