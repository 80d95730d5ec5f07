"""A bounded soak on loopback: the three services as separate processes, mixed clients, one
worker restart mid-run, and the check that no admitted request was lost or answered wrong.

    python benchmarks/soak.py [--duration 120] [--clients 4] [--model tiny|smollm2-135m|DIR]
                              [--restart target|draft|coordinator|none] [--restart-signal KILL|TERM]
                              [--json-out FILE]

Starts `python -m specdec serve target|draft|coordinator` (tiny random models saved to a
temporary directory by default), then runs `--clients` concurrent clients for `--duration`
seconds. Each request is one of:

- greedy: a fixed prompt, greedy, random max_new_tokens and k, speculation mostly on; must
  equal the target model's own `generate()` output, computed in this process beforehand;
- sampled: a fixed (prompt, temperature, top_k, top_p, seed); must equal the same request's
  run before the soak (target alone, no speculation): seeded output is a function of the seed;
- cancel: a greedy request cancelled after a few messages; what arrived must be a prefix of
  the expected output;
- deadline: a greedy or sampled request with a tight deadline; OK (then exact) or
  DEADLINE_EXCEEDED (then what arrived is a prefix);
- bad: a malformed request; expected INVALID_ARGUMENT (anything else is listed in
  `bad_unexpected`, which does not fail the run).

At `--restart-at` of the run the chosen service gets SIGKILL (or SIGTERM) and a new process
takes its port. With `--restart coordinator` two coordinator replicas serve (over the same
workers) and the clients' channel knows both: the streams the killed one was serving break,
and the clients resume them on the other (specdec.client resumes by default; every request
but the bad ones goes through it, and `resumes` counts them; `--no-resume` turns it off). By default the new process is an interpreter started earlier with the
imports done, waiting to run the same `specdec serve` command line: the restart then tests
that a worker losing every session is harmless, not how fast Python imports torch on a busy
machine (the coordinator gives a worker ~6 s of retries, then answers UNAVAILABLE by
design). `--cold-restart` starts a fresh `python -m specdec serve` instead.

An admitted request is one the coordinator did not refuse at the door (RESOURCE_EXHAUSTED
is retried after the hint). Lost: an admitted request that ended in any status but OK, its
own cancel or its own deadline. Wrong: tokens that differ from the expected ones. Prints one
JSON object (requests served, errors by code, peak RSS of each service process, restart,
lost, wrong) and exits 1 if anything was lost or wrong or a service died on its own, 2 if
the run did not finish within `--max-wall` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from specdec.client import NO_RESUME, Client, Resume, make_request  # noqa: E402
from specdec.v1 import coordinator_pb2  # noqa: E402

MAX_WALL_S = 600.0
TINY = "tiny"
NGRAM = "ngram"
GENERATE = "/specdec.v1.Coordinator/Generate"
StatusCode = grpc.StatusCode

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Summarise: the cat sat on the mat and slept. The cat sat on the mat.",
    "def add(a, b):\n    return a + b",
    "Héllo wörld — naïve café 🙂",
    "Write a short story about a robot who learns to paint.",
    "Speculative decoding drafts tokens cheaply and verifies them with the target model.",
]
# (temperature, top_k, top_p) of the seeded sampling requests.
SAMPLING = [(0.8, 40, 0.95), (1.3, 0, 1.0), (0.5, 5, 0.9)]
KIND_WEIGHTS = {"greedy": 4, "sampled": 3, "cancel": 2, "deadline": 2, "bad": 1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- service processes -----------------------------------------------------------------------

# Does the slow imports, then waits for a line on stdin before running `specdec serve`: a
# replacement worker that takes a freed port within a second of being told to.
WARM_START = (
    "import sys\n"
    "import specdec.cli, specdec.models, target_worker.service, draft_worker.service\n"
    "import transformers\n"
    "sys.stdin.readline()\n"
    "sys.exit(specdec.cli.main(sys.argv[1:]))\n"
)


def read_status_kib(pid: int, key: str) -> int | None:
    """A VmRSS/VmHWM line of /proc/<pid>/status, in KiB (None once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@dataclass
class ServiceProcess:
    """One `specdec serve` process (one instance: a restarted worker is a new one)."""

    name: str
    port: int
    argv: list[str]
    log_path: Path
    env: dict
    process: subprocess.Popen | None = None
    peak_rss_kib: int = 0
    expected_exit: bool = False
    host: str = "127.0.0.1"  # where it serves (a loopback address)
    cwd: Path = REPO  # the source tree it runs (`python -m specdec` imports from here first)

    def spawn(self, warm: bool = False) -> None:
        log = open(self.log_path, "ab")
        command = [sys.executable, "-c", WARM_START] if warm else [sys.executable, "-m", "specdec"]
        self.process = subprocess.Popen([*command, *self.argv], stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.PIPE if warm else subprocess.DEVNULL, env=self.env,
                                        cwd=self.cwd)
        log.close()

    def go(self) -> None:
        """Lets a warm process run its command."""
        self.process.stdin.write(b"go\n")
        self.process.stdin.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def sample_memory(self) -> None:
        if self.alive():
            for key in ("VmHWM", "VmRSS"):
                value = read_status_kib(self.pid, key)
                if value is not None:
                    self.peak_rss_kib = max(self.peak_rss_kib, value)

    def wait_serving(self, timeout_s: float) -> None:
        """Polls the standard health service until SERVING; raises if the process dies."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(f"{self.host}:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if not self.alive():
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} not SERVING after {timeout_s:g} s; see {self.log_path}")

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 15.0) -> int | None:
        if self.process is None:
            return None
        if self.alive():
            self.sample_memory()
            self.process.send_signal(sig)
            try:
                self.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        return self.process.returncode


# --- expected outputs --------------------------------------------------------------------------

@dataclass
class Models:
    target_spec: str
    draft_spec: str
    tokenizer: object
    vocab_size: int
    max_context: int


def prepare_models(args, workdir: Path) -> tuple[Models, object]:
    """Model specs for the services, and the target model loaded here for the references."""
    from specdec.models import load_model, max_context

    if args.model == TINY:
        from tests.factories import make_tiny_model, make_tiny_tokenizer, save_model_dir

        tokenizer = make_tiny_tokenizer()
        target_spec = str(save_model_dir(workdir / "target", make_tiny_model(tokenizer, seed=0, layers=2), tokenizer))
        draft_spec = args.draft or str(save_model_dir(
            workdir / "draft", make_tiny_model(tokenizer, seed=1, layers=1, hidden=32), tokenizer))
    else:
        target_spec, draft_spec = args.model, args.draft or NGRAM
    model, tokenizer = load_model(target_spec)
    return Models(target_spec, draft_spec, tokenizer, int(model.config.vocab_size), max_context(model)), model


def chat_ids(tokenizer, prompt: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target alone: HF generate, greedy; generated ids only, EOS included when hit."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


# --- clients -------------------------------------------------------------------------------------

@dataclass
class Plan:
    """What the clients send and what they must get back."""

    greedy: dict[str, list[int]]  # prompt -> expected tokens for max_new_tokens
    sampled: dict[tuple, list[int]]  # (prompt, temperature, top_k, top_p, seed) -> expected tokens
    bad: list[tuple[str, bytes]]  # (label, serialized request)
    max_new_tokens: int
    request_timeout_s: float
    resume: Resume = Resume()


@dataclass
class Record:
    client: int
    kind: str
    label: str
    began_s: float
    ended_s: float = 0.0
    code: str = ""
    details: str = ""
    tokens: list[int] = field(default_factory=list)
    expected: list[int] | None = None
    admitted: bool = True
    resyncs: int = 0
    resumes: int = 0
    verdict: str = ""  # ok | lost | wrong | refused | bad-ok | bad-unexpected


def sampled_request(key: tuple, max_new: int) -> coordinator_pb2.GenerateRequest:
    prompt, temperature, top_k, top_p, seed = key
    return make_request(prompt, max_new_tokens=max_new, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def bad_requests(vocab_size: int, max_context: int) -> list[tuple[str, bytes]]:
    good = make_request(PROMPTS[0], max_new_tokens=4)
    too_many_stops = make_request(PROMPTS[0], max_new_tokens=4, stop=[str(i) for i in range(64)])
    no_prompt = coordinator_pb2.GenerateRequest(max_new_tokens=4)
    bad_role = coordinator_pb2.GenerateRequest(max_new_tokens=4)
    bad_role.chat.messages.add(role="robot", content="hi")
    # Proto3 strings must be UTF-8: a stop string of raw bytes 0xff 0xfe.
    invalid_utf8 = good.SerializeToString() + b"\x3a\x02\xff\xfe"
    return [
        ("max_new_tokens=0", make_request(PROMPTS[0], max_new_tokens=0).SerializeToString()),
        ("token_id=-1", make_request([1, -1, 2], max_new_tokens=4).SerializeToString()),
        ("token_id=vocab", make_request([1, vocab_size], max_new_tokens=4).SerializeToString()),
        ("prompt>context", make_request([1] * max_context, max_new_tokens=4).SerializeToString()),
        ("no prompt", no_prompt.SerializeToString()),
        ("role=robot", bad_role.SerializeToString()),
        ("temperature=nan", make_request(PROMPTS[0], max_new_tokens=4, temperature=float("nan")).SerializeToString()),
        ("top_p=0", make_request(PROMPTS[0], max_new_tokens=4, temperature=1.0, top_p=0.0).SerializeToString()),
        ("k=99", make_request(PROMPTS[0], max_new_tokens=4, k=99).SerializeToString()),
        ("64 stop strings", too_many_stops.SerializeToString()),
        ("stop=invalid utf-8", invalid_utf8),
    ]


async def run_call(call, cancel_after: int | None, record: Record) -> None:
    """Reads a stream to its end (or cancels it after `cancel_after` messages)."""
    messages = 0
    try:
        if cancel_after == 0:
            call.cancel()
        else:
            async for response in call:
                record.tokens.extend(response.token_ids)
                record.resyncs += response.stats.resyncs
                messages += 1
                if messages == cancel_after:
                    call.cancel()
                    break
        record.code = (await call.code()).name
        record.details = await call.details() or ""
    except grpc.aio.AioRpcError as exc:
        record.code, record.details = exc.code().name, exc.details() or ""


async def run_resuming(client: Client, request, timeout: float, cancel_after: int | None, record: Record,
                       resume: Resume) -> None:
    """Like run_call, through the client's resuming stream (specdec.client.Client.generate)."""
    if cancel_after == 0:
        record.code = "CANCELLED"
        return
    stream = client.generate(request, timeout=timeout, resume=resume)
    messages = 0
    try:
        async for response in stream:
            record.tokens.extend(response.token_ids)
            record.resyncs += response.stats.resyncs
            record.resumes += response.stats.resumes
            messages += 1
            if messages == cancel_after:
                record.code = "CANCELLED"
                return
        record.code = "OK"
    except grpc.aio.AioRpcError as exc:
        record.code, record.details = exc.code().name, exc.details() or ""
    finally:
        await stream.aclose()


def judge(record: Record, own_status: str | None) -> str:
    if record.kind == "bad":
        return "bad-ok" if record.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED") else "bad-unexpected"
    if record.code == "RESOURCE_EXHAUSTED" and not record.tokens:
        record.admitted = False
        return "refused"
    if record.code == "OK":
        return "ok" if record.tokens == record.expected else "wrong"
    if record.code == own_status:
        return "ok" if record.tokens == record.expected[:len(record.tokens)] else "wrong"
    return "lost"


async def one_request(client: Client, client_id: int, rng: random.Random, plan: Plan, t0: float) -> Record:
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    max_new = rng.randint(1, plan.max_new_tokens)
    timeout, cancel_after, own_status = plan.request_timeout_s, None, None
    if kind == "bad":
        label, payload = rng.choice(plan.bad)
        record = Record(client_id, kind, label, time.monotonic() - t0)
        generate = client.channel.unary_stream(GENERATE, request_serializer=lambda data: data,
                                               response_deserializer=coordinator_pb2.GenerateResponse.FromString)
        await run_call(generate(payload, timeout=timeout), None, record)
    else:
        if kind == "sampled" or (kind == "deadline" and rng.random() < 0.5):
            key = rng.choice(list(plan.sampled))
            request, expected, label = sampled_request(key, max_new), plan.sampled[key], f"sampled {key}"
        else:
            prompt = rng.choice(list(plan.greedy))
            k = rng.choice([None, 1, 2, 4, 8])
            request = make_request(prompt, max_new_tokens=max_new, k=k, speculate=rng.random() < 0.9)
            expected, label = plan.greedy[prompt], f"greedy {prompt[:24]!r} k={k}"
        if kind == "cancel":
            cancel_after, own_status = rng.randint(0, 3), "CANCELLED"
        elif kind == "deadline":
            timeout, own_status = rng.uniform(0.02, 1.0), "DEADLINE_EXCEEDED"
        record = Record(client_id, kind, f"{label} max_new={max_new}", time.monotonic() - t0,
                        expected=expected[:max_new])
        await run_resuming(client, request, timeout, cancel_after, record, plan.resume)
    record.ended_s = time.monotonic() - t0
    record.verdict = judge(record, own_status)
    return record


async def client_loop(address: str, client_id: int, seed: int, plan: Plan, t0: float, stop_at: float,
                      records: list[Record]) -> None:
    rng = random.Random(seed * 1000 + client_id)
    async with Client(address) as client:
        while time.monotonic() < stop_at:
            record = await one_request(client, client_id, rng, plan, t0)
            records.append(record)
            if record.verdict == "refused":
                await asyncio.sleep(1.0)  # the coordinator's retry-after hint


# --- the run ---------------------------------------------------------------------------------------

@dataclass
class Restart:
    worker: str
    signal: str
    cold: bool
    at_s: float | None = None
    ready_s: float | None = None
    old_pid: int | None = None
    new_pid: int | None = None
    old_exit: int | None = None
    error: str = ""

    def to_json(self) -> dict:
        happened = self.ready_s is not None and not self.error
        return {"worker": self.worker, "signal": self.signal, "cold": self.cold, "happened": happened,
                "at_s": _round(self.at_s), "ready_s": _round(self.ready_s),
                "outage_s": _round(self.ready_s - self.at_s) if happened else None,
                "old_pid": self.old_pid, "new_pid": self.new_pid, "old_exit": self.old_exit, "error": self.error}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def restart_worker(old: ServiceProcess, spare: ServiceProcess | None, restart: Restart, t0: float,
                   startup_timeout_s: float) -> ServiceProcess:
    """Kills a worker, waits for its port to be free, and brings up the replacement on it."""
    restart.old_pid = old.pid
    old.expected_exit = True
    old.sample_memory()
    restart.at_s = time.monotonic() - t0
    old.process.send_signal(signal.SIGKILL if restart.signal == "KILL" else signal.SIGTERM)
    restart.old_exit = old.process.wait(60)
    if spare is None:
        spare = ServiceProcess(old.name + "#2", old.port, old.argv, old.log_path, old.env)
        spare.spawn()
    else:
        spare.go()
    restart.new_pid = spare.pid
    spare.wait_serving(startup_timeout_s)
    restart.ready_s = time.monotonic() - t0
    return spare


async def soak(args, services: dict[str, ServiceProcess], spare: ServiceProcess | None, plan: Plan,
               restart: Restart, startup_timeout_s: float) -> tuple[list[Record], float]:
    records: list[Record] = []
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    address = f"127.0.0.1:{services['coordinator'].port}"
    if "coordinator-b" in services:  # both replicas; pick_first: the first while it is up
        address = f"ipv4:127.0.0.1:{services['coordinator'].port},127.0.0.1:{services['coordinator-b'].port}"
    sampling = True

    async def sample_memory() -> None:
        while sampling:
            for service in list(services.values()):
                service.sample_memory()
            await asyncio.sleep(0.5)

    async def do_restart() -> None:
        await asyncio.sleep(args.duration * args.restart_at)
        name = restart.worker
        try:
            services[name] = await asyncio.to_thread(restart_worker, services[name], spare, restart, t0,
                                                     startup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported, and the run fails
            restart.error = f"{type(exc).__name__}: {exc}"

    memory = asyncio.create_task(sample_memory())
    restarter = asyncio.create_task(do_restart()) if restart.worker != "none" else None
    await asyncio.gather(*(client_loop(address, i, args.seed, plan, t0, stop_at, records)
                           for i in range(args.clients)))
    if restarter is not None:
        await restarter
    sampling = False
    await memory
    return records, time.monotonic() - t0


def report(args, records: list[Record], elapsed: float, restart: Restart, instances: list[ServiceProcess],
           crashed: list[str], exit_codes: dict) -> dict:
    by_kind: dict[str, Counter] = {}
    errors = Counter()
    for record in records:
        by_kind.setdefault(record.kind, Counter())[record.code] += 1
        if record.code != "OK":
            errors[record.code] += 1
    admitted = [r for r in records if r.kind != "bad" and r.admitted]
    lost = [r for r in admitted if r.verdict == "lost"]
    wrong = [r for r in admitted if r.verdict == "wrong"]
    served = [r for r in records if r.code == "OK"]
    after_restart = [r for r in admitted if r.verdict == "ok" and restart.ready_s is not None
                     and r.ended_s > restart.ready_s and r.code == "OK"]
    across_restart = [r for r in admitted if restart.at_s is not None and r.began_s < restart.at_s < r.ended_s]

    def example(record: Record) -> dict:
        return {"client": record.client, "kind": record.kind, "request": record.label, "status": record.code,
                "details": record.details[:300], "began_s": round(record.began_s, 3),
                "ended_s": round(record.ended_s, 3), "tokens": record.tokens, "expected": record.expected}

    restart_json = restart.to_json()
    passed = not lost and not wrong and not crashed and (restart.worker == "none" or restart_json["happened"])
    return {
        "passed": passed,
        "config": {"duration_s": args.duration, "clients": args.clients, "model": args.model,
                   "draft": args.draft or ("tiny-draft" if args.model == TINY else NGRAM),
                   "max_new_tokens": args.max_new_tokens, "seed": args.seed, "threads": args.threads,
                   "restart": args.restart, "resume": not args.no_resume},
        "elapsed_s": round(elapsed, 3),
        "requests": len(records),
        "served": len(served),
        "served_per_s": round(len(served) / elapsed, 3) if elapsed else 0.0,
        "tokens_served": sum(len(r.tokens) for r in served),
        "by_kind": {kind: dict(codes) for kind, codes in sorted(by_kind.items())},
        "errors_by_code": dict(errors),
        "admitted": len(admitted),
        "refused": sum(1 for r in records if r.verdict == "refused"),
        "lost": len(lost),
        "wrong": len(wrong),
        "lost_examples": [example(r) for r in lost[:5]],
        "wrong_examples": [example(r) for r in wrong[:5]],
        "bad_unexpected": dict(Counter(f"{r.label}: {r.code}: {r.details[:120]}"
                                       for r in records if r.verdict == "bad-unexpected")),
        "resyncs": sum(r.resyncs for r in records),
        "resumes": sum(r.resumes for r in records),
        "in_flight_at_restart": len(across_restart),
        "served_after_restart": len(after_restart),
        "restart": restart_json,
        "peak_rss_mib": {s.name: round(s.peak_rss_kib / 1024, 1) for s in instances if s.process is not None},
        "service_pids": {s.name: s.pid for s in instances if s.process is not None},
        "crashed": crashed,
        "exit_codes": exit_codes,
    }


def main(argv: list[str] | None = None) -> int:
    began = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default %(default)s)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default %(default)s)")
    parser.add_argument("--model", default=TINY, help="target: 'tiny' (random, in a temp dir), smollm2-135m, a dir")
    parser.add_argument("--draft", default=None, help="draft spec or 'ngram' (default: a tiny model / ngram)")
    parser.add_argument("--k", type=int, default=4, help="the coordinator's default k")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="largest max_new_tokens a client asks for")
    parser.add_argument("--restart", choices=["target", "draft", "coordinator", "none"], default="target")
    parser.add_argument("--restart-signal", choices=["KILL", "TERM"], default="KILL")
    parser.add_argument("--no-resume", action="store_true",
                        help="clients do not resume broken streams (to see what resuming saves)")
    parser.add_argument("--restart-at", type=float, default=0.4, help="fraction of --duration (default %(default)s)")
    parser.add_argument("--cold-restart", action="store_true",
                        help="restart with a fresh `python -m specdec serve` instead of a pre-imported interpreter")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each service")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' choices and the sampling seeds")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="deadline of every other request: one that runs into it counts as lost (a hang)")
    parser.add_argument("--max-wall", type=float, default=MAX_WALL_S, help="hard limit of the whole run, seconds")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--workdir", type=Path, default=None, help="models and service logs (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (always kept on failure)")
    args = parser.parse_args(argv)
    # A SIGTERM to the soak still stops the services it started (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not 0 < args.duration <= args.max_wall - 60:
        parser.error(f"--duration must be in (0, {args.max_wall - 60:g}] (the run stops by itself within --max-wall)")
    if args.clients < 1:
        parser.error("--clients must be >= 1")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="specdec-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    startup_timeout_s = 300.0 if args.model != TINY else 120.0
    instances: list[ServiceProcess] = []
    services: dict[str, ServiceProcess] = {}
    restart = Restart(args.restart, args.restart_signal, args.cold_restart)
    result: dict | None = None
    code = 1
    try:
        import torch

        torch.set_num_threads(max(1, args.threads))
        models, model = prepare_models(args, workdir)
        names = ("target", "draft", "coordinator") + (("coordinator-b",) if args.restart == "coordinator" else ())
        ports = {name: free_port() for name in names}
        common = ["--host", "127.0.0.1", "--grace-period", "2"]
        argvs = {
            "target": ["serve", "target", "--port", str(ports["target"]), "--model", models.target_spec, *common],
            "draft": ["serve", "draft", "--port", str(ports["draft"]), "--model", models.draft_spec, *common],
            "coordinator": ["serve", "coordinator", "--port", str(ports["coordinator"]), "--http-port", "0", *common,
                            "--target-addr", f"127.0.0.1:{ports['target']}",
                            "--draft-addr", f"127.0.0.1:{ports['draft']}",
                            "--tokenizer", models.target_spec, "--k", str(args.k)],
        }
        if "coordinator-b" in ports:  # a second replica over the same workers
            argvs["coordinator-b"] = [str(ports["coordinator-b"]) if value == str(ports["coordinator"]) else value
                                      for value in argvs["coordinator"]]
        # All start at once: a coordinator waits for the workers by itself.
        for name in names:
            services[name] = ServiceProcess(name, ports[name], argvs[name], workdir / f"{name}.log", env)
            instances.append(services[name])
            services[name].spawn()
        for name in names:
            services[name].wait_serving(startup_timeout_s)

        # The expected outputs: greedy from the target model here, sampled from the same
        # requests through the services (target alone) before any load or restart.
        max_new = args.max_new_tokens
        greedy = {p: reference_greedy(model, chat_ids(models.tokenizer, p), max_new) for p in PROMPTS}
        del model
        rng = random.Random(args.seed)
        keys = [(prompt, *params, rng.randrange(2**63)) for prompt in PROMPTS[:3] for params in SAMPLING]

        spare = None
        if args.restart != "none" and not args.cold_restart:
            old = services[args.restart]
            spare = ServiceProcess(old.name + "#2", old.port, old.argv, old.log_path, env)
            spare.spawn(warm=True)
            instances.append(spare)

        async def baselines_then_soak() -> tuple[list[Record], float]:
            # One event loop for every grpc.aio channel of the run.
            async with Client(f"127.0.0.1:{ports['coordinator']}") as client:
                sampled = {}
                for key in keys:
                    request = sampled_request(key, max_new)
                    request.disable_speculation = True
                    sampled[key] = (await client.complete(request, timeout=args.request_timeout)).token_ids
                mismatched = []
                for prompt in PROMPTS:
                    request = make_request(prompt, max_new_tokens=max_new, speculate=False)
                    if (await client.complete(request, timeout=args.request_timeout)).token_ids != greedy[prompt]:
                        mismatched.append(prompt)
            if mismatched:
                raise RuntimeError(f"before the soak, the services' target-only greedy output differs from the "
                                   f"model's own generate() for {mismatched}")
            plan = Plan(greedy, sampled, bad_requests(models.vocab_size, models.max_context), max_new,
                        args.request_timeout, NO_RESUME if args.no_resume else Resume())
            return await soak(args, services, spare, plan, restart, startup_timeout_s)

        remaining = args.max_wall - (time.monotonic() - began) - 30.0
        try:
            records, elapsed = asyncio.run(asyncio.wait_for(baselines_then_soak(), timeout=max(remaining, 1.0)))
        except asyncio.TimeoutError:
            result = {"passed": False, "error": f"did not finish within --max-wall {args.max_wall:g} s"}
            code = 2
            return code
        for name, service in services.items():
            if service not in instances:
                instances.append(service)
        crashed = [s.name for s in instances if not s.expected_exit and s.process is not None and not s.alive()]
        exit_codes = {}
        for name in ("coordinator", "coordinator-b", "draft", "target"):
            if name in services:
                exit_codes[services[name].name] = services[name].stop()
        result = report(args, records, elapsed, restart, instances, crashed, exit_codes)
        code = 0 if result["passed"] else 1
    except Exception as exc:  # noqa: BLE001 - a set-up failure is reported like a failed run
        result = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        code = 1
    finally:
        for service in [*instances, *services.values()]:
            service.stop(signal.SIGKILL, wait_s=5.0)
        if result is not None:
            result["workdir"] = str(workdir) if (code != 0 or args.keep) else None
            text = json.dumps(result, indent=2, ensure_ascii=False)
            print(text)
            if args.json_out is not None:
                args.json_out.write_text(text + "\n")
        if code == 0 and not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
