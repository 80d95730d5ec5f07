"""A chaos run on loopback: overlapping faults under steady load, and a Jepsen-style history of
every request checked against the target model alone.

    python benchmarks/chaos.py [--duration 420] [--clients 4] [--json-out FILE]

The fleet, every service a separate `specdec serve` process:

- two coordinators (the clients' channel knows both; a broken stream resumes on the other),
  with hedged target rounds, short re-resolution and health polls;
- two target replicas and two draft replicas (a tiny random draft model), each kind behind one
  name, `targets.chaos.test` / `drafts.chaos.test`, that every coordinator re-resolves;
- a target with other weights (same tokenizer and shape), which the name points at for a while.

Names resolve through a file the run rewrites (the one part that is simulated: pointing the
system resolver at a DNS server needs root). The coordinators run with `getaddrinfo` answering
`*.chaos.test` from that file, NXDOMAIN for a name it leaves empty; every other part is the
product as shipped. Replicas of a kind share a port on distinct loopback addresses, as pods
behind a headless Service share a port on distinct IPs.

The schedule, for the full 420 s (a shorter `--duration` scales every time and length, so the
60 s run in the test suite goes through the same faults, shorter; `--faults` picks some):

    target-kill         SIGKILL one of two targets; back after 8 s
    draft-kill          SIGKILL one of two drafts; back after 8 s
    target-stop         SIGSTOP a target for 40 s (a frozen process) ...
    target-kill-last    ... and, while it is stopped, SIGKILL the only other one; back after 6 s
    slow-target         a target stopped 80% of every 100 ms for 40 s (hedging's case) ...
    dns-flap            ... while both names' answers flap every 2 s for 40 s: a replica
                        missing, a dead address added, no answer at all
    wrong-weights       the targets' name also answers a replica with other weights, 30 s
    coordinator-kill    SIGKILL a coordinator; back after 5 s
    draft-kill-last     SIGKILL one draft, then the other (none left); back after 6 s and 20 s
    flood               6 more clients sending prompts of the model's whole context, 40 s

Each request is greedy (must equal the target's own `generate()`) or seeded sampling (must
equal the same request served before the faults, target alone). The history, one entry per
request: ok (exact output, or RESOURCE_EXHAUSTED at the door: refused, never admitted), lost
(admitted, then any other error), wrong (any token differs), unknown (still running when the
run ended: the history cannot say). Prints one JSON object with the counts, p50/p99 latency of
the requests overlapping each fault (and of those overlapping none), what each fault did, and
the coordinators' refusals of the wrong-weights replica; exits 1 unless 0 lost, 0 wrong, 0
unknown, every fault happened and no service died on its own; 2 past `--max-wall`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak
from soak import REPO, Record, ServiceProcess, free_port

from specdec.client import Client, make_request

FULL_S = 420.0
MAX_WALL_S = 600.0
TARGETS, DRAFTS = "targets.chaos.test", "drafts.chaos.test"
# Distinct loopback addresses, one port per kind: pods behind a headless Service.
IPS = {"t1": "127.0.0.11", "t2": "127.0.0.12", "wrong": "127.0.0.13", "d1": "127.0.0.21", "d2": "127.0.0.22"}
DEAD_IP = "127.0.0.19"  # an address nothing listens on
FLOOD_NEW_TOKENS = 8

# Every service process starts through this: `*.chaos.test` resolves from the hosts file (a
# name missing or empty there: NXDOMAIN); then it waits for a line on stdin (a warm spare
# waits until its fault needs it) and runs `specdec serve`.
LAUNCH = (
    "import json, os, socket, sys\n"
    "_real = socket.getaddrinfo\n"
    "def _chaos_getaddrinfo(host, port, *args, **kwargs):\n"
    "    if isinstance(host, str) and host.endswith('.chaos.test'):\n"
    "        try:\n"
    "            with open(os.environ['SPECDEC_CHAOS_HOSTS']) as f:\n"
    "                ips = json.load(f).get(host) or []\n"
    "        except (OSError, ValueError):\n"
    "            ips = []\n"
    "        if not ips:\n"
    "            raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')\n"
    "        return [info for ip in ips for info in _real(ip, port, *args, **kwargs)]\n"
    "    return _real(host, port, *args, **kwargs)\n"
    "socket.getaddrinfo = _chaos_getaddrinfo\n"
    + soak.WARM_START
)


@dataclass
class ChaosProcess(ServiceProcess):
    """A service started through LAUNCH: at once, or warm (imports done, waiting for go())."""

    metrics_port: int | None = None

    def spawn(self, warm: bool = False) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-c", LAUNCH, *self.argv], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.PIPE, env=self.env, cwd=REPO)
        if not warm:
            self.go()


class Hosts:
    """The names' answers, rewritten atomically (a reader never sees half a file)."""

    def __init__(self, path: Path, answers: dict[str, list[str]]):
        self.path, self.answers = path, dict(answers)
        self.normal = dict(answers)
        self.write()

    def set(self, name: str, ips: list[str]) -> None:
        self.answers[name] = list(ips)
        self.write()

    def restore(self, name: str) -> None:
        self.set(name, self.normal[name])

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.answers))
        os.replace(tmp, self.path)


# --- faults ------------------------------------------------------------------------------------

@dataclass
class Fault:
    name: str
    at_s: float  # on the full schedule; scaled
    length_s: float  # how long the fault lasts (to the restart, the SIGCONT, the restore)
    began_s: float | None = None
    ended_s: float | None = None  # the fault over and its service serving again
    details: dict = field(default_factory=dict)
    error: str = ""

    def to_json(self) -> dict:
        return {"at_s": _round(self.began_s), "ended_s": _round(self.ended_s),
                "happened": self.began_s is not None and self.ended_s is not None and not self.error,
                **self.details, **({"error": self.error} if self.error else {})}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


SCHEDULE = [  # name, start and length on the full 420 s schedule
    ("target-kill", 20, 8),
    ("draft-kill", 45, 8),
    ("target-stop", 70, 40),
    ("target-kill-last", 80, 6),
    ("slow-target", 125, 40),
    ("dns-flap", 140, 40),
    ("wrong-weights", 190, 30),
    ("coordinator-kill", 230, 5),
    ("draft-kill-last", 258, 20),
    ("flood", 300, 40),
]
# Which service each kill takes down (its warm spare takes its address).
KILLS = {"target-kill": ["t1"], "draft-kill": ["d1"], "target-kill-last": ["t1"], "coordinator-kill": ["c1"],
         "draft-kill-last": ["d2", "d1"]}


class Chaos:
    def __init__(self, args, services: dict[str, ChaosProcess], spares: dict[str, list[ChaosProcess]], hosts: Hosts,
                 scale: float, t0: float, startup_timeout_s: float):
        self.args, self.services, self.spares, self.hosts = args, services, spares, hosts
        self.scale, self.t0, self.startup_timeout_s = scale, t0, startup_timeout_s
        self.flooding = asyncio.Event()
        self.stopped_pids: set[int] = set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, fault: Fault) -> None:
        await asyncio.sleep(max(0.0, fault.at_s * self.scale - self.now()))
        fault.began_s = self.now()
        length = max(fault.length_s * self.scale, 1.0)
        try:
            await getattr(self, fault.name.replace("-", "_"))(fault, length)
            fault.ended_s = self.now()
        except Exception as exc:  # noqa: BLE001 - reported, and the run fails
            fault.error = f"{type(exc).__name__}: {exc}"

    async def _kill(self, name: str) -> ChaosProcess:
        old = self.services[name]
        old.expected_exit = True
        old.sample_memory()
        old.process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(old.process.wait, 30)
        return old

    async def _restart(self, name: str, fault: Fault) -> None:
        spare = self.spares[name].pop(0)
        spare.go()
        self.services[name] = spare
        await asyncio.to_thread(spare.wait_serving, self.startup_timeout_s)
        fault.details.setdefault("restarted", []).append({"service": name, "pid": spare.pid,
                                                          "serving_s": _round(self.now())})

    async def _kill_then_restart(self, fault: Fault, name: str, down_s: float) -> None:
        old = await self._kill(name)
        fault.details.setdefault("killed", []).append({"service": name, "pid": old.pid, "at_s": _round(self.now())})
        await asyncio.sleep(down_s)
        await self._restart(name, fault)

    async def target_kill(self, fault: Fault, length: float) -> None:
        await self._kill_then_restart(fault, "t1", length)

    async def draft_kill(self, fault: Fault, length: float) -> None:
        await self._kill_then_restart(fault, "d1", length)

    async def target_kill_last(self, fault: Fault, length: float) -> None:
        fault.details["other_target_stopped"] = self.services["t2"].pid in self.stopped_pids
        await self._kill_then_restart(fault, "t1", length)

    async def coordinator_kill(self, fault: Fault, length: float) -> None:
        await self._kill_then_restart(fault, "c1", length)

    async def draft_kill_last(self, fault: Fault, length: float) -> None:
        # d2 down for the whole length; d1, the last one serving, down for 30% of it.
        second = asyncio.create_task(self._kill_then_restart(fault, "d2", length))
        await asyncio.sleep(length * 0.2)
        await self._kill_then_restart(fault, "d1", length * 0.3)
        await second

    async def target_stop(self, fault: Fault, length: float) -> None:
        process = self.services["t2"]
        self.stopped_pids.add(process.pid)
        process.process.send_signal(signal.SIGSTOP)
        fault.details["stopped"] = {"service": "t2", "pid": process.pid, "for_s": round(length, 3)}
        try:
            await asyncio.sleep(length)
        finally:
            process.process.send_signal(signal.SIGCONT)
            self.stopped_pids.discard(process.pid)

    async def slow_target(self, fault: Fault, length: float) -> None:
        process, period, stopped = self.services["t1"], 0.1, 0.8
        fault.details["slowed"] = {"service": "t1", "pid": process.pid, "stopped_share": stopped}
        end = time.monotonic() + length
        try:
            while time.monotonic() < end and process.alive():
                process.process.send_signal(signal.SIGSTOP)
                await asyncio.sleep(period * stopped)
                process.process.send_signal(signal.SIGCONT)
                await asyncio.sleep(period * (1 - stopped))
        finally:
            if process.alive():
                process.process.send_signal(signal.SIGCONT)

    async def dns_flap(self, fault: Fault, length: float) -> None:
        cycle = [
            {TARGETS: [IPS["t2"]], DRAFTS: [IPS["d1"]]},  # a replica missing from each answer
            {TARGETS: [IPS["t1"], IPS["t2"], DEAD_IP], DRAFTS: [IPS["d1"], IPS["d2"], DEAD_IP]},  # a dead one added
            {TARGETS: [], DRAFTS: []},  # NXDOMAIN: keep the last answer
            {TARGETS: [IPS["t1"]], DRAFTS: [IPS["d2"]]},
        ]
        end, flips = time.monotonic() + length, 0
        try:
            while time.monotonic() < end:
                for name, ips in cycle[flips % len(cycle)].items():
                    self.hosts.set(name, ips)
                flips += 1
                await asyncio.sleep(min(2.0, max(0.0, end - time.monotonic())))
        finally:
            self.hosts.restore(TARGETS)
            self.hosts.restore(DRAFTS)
        fault.details["flips"] = flips

    async def wrong_weights(self, fault: Fault, length: float) -> None:
        self.hosts.set(TARGETS, [*self.hosts.normal[TARGETS], IPS["wrong"]])
        try:
            await asyncio.sleep(length)
        finally:
            fault.details["refused_by"] = {name: refused_count(self.services[name])
                                           for name in ("c1", "c2") if self.services[name].alive()}
            self.hosts.restore(TARGETS)

    async def flood(self, fault: Fault, length: float) -> None:
        self.flooding.set()
        try:
            await asyncio.sleep(length)
        finally:
            self.flooding.clear()


def refused_count(coordinator: ChaosProcess) -> float:
    """specdec_replicas_refused_total summed, from the coordinator's /metrics."""
    port = coordinator.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specdec_replicas_refused_total{"))


# --- load --------------------------------------------------------------------------------------

@dataclass
class Load:
    greedy: dict[str, list[int]]
    sampled: dict[tuple, list[int]]
    flood: list[tuple[list[int], list[int]]]  # (prompt ids, expected)
    max_new_tokens: int
    request_timeout_s: float


async def one_request(client: Client, client_id: int, rng: random.Random, load: Load, t0: float,
                      flood: bool) -> Record:
    if flood:
        prompt, expected = rng.choice(load.flood)
        request = make_request(prompt, max_new_tokens=FLOOD_NEW_TOKENS, k=rng.choice([None, 2, 4]))
        kind, label = "flood", f"flood {len(prompt)} tokens"
    elif rng.random() < 0.5:
        key = rng.choice(list(load.sampled))
        max_new = rng.randint(1, load.max_new_tokens)
        request, expected = soak.sampled_request(key, max_new), load.sampled[key][:max_new]
        kind, label = "sampled", f"sampled {key} max_new={max_new}"
    else:
        prompt = rng.choice(list(load.greedy))
        max_new, k = rng.randint(1, load.max_new_tokens), rng.choice([None, 1, 2, 4, 8])
        request = make_request(prompt, max_new_tokens=max_new, k=k, speculate=rng.random() < 0.9)
        expected = load.greedy[prompt][:max_new]
        kind, label = "greedy", f"greedy {prompt[:24]!r} k={k} max_new={max_new}"
    record = Record(client_id, kind, label, time.monotonic() - t0, expected=expected)
    await soak.run_resuming(client, request, load.request_timeout_s, None, record, soak.Resume())
    record.ended_s = time.monotonic() - t0
    record.verdict = soak.judge(record, None)
    return record


async def client_loop(address: str, client_id: int, seed: int, load: Load, t0: float, stop_at: float,
                      records: list[Record], in_flight: dict, gate: asyncio.Event | None = None) -> None:
    rng = random.Random(seed * 1000 + client_id)
    async with Client(address) as client:
        while time.monotonic() < stop_at:
            if gate is not None and not gate.is_set():
                await asyncio.sleep(0.1)
                continue
            task = asyncio.current_task()
            in_flight[task] = (client_id, time.monotonic() - t0)
            record = await one_request(client, client_id, rng, load, t0, flood=gate is not None)
            del in_flight[task]
            records.append(record)
            if record.verdict == "refused":
                await asyncio.sleep(1.0)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def window_stats(records: list[Record]) -> dict:
    latencies = [r.ended_s - r.began_s for r in records if r.verdict == "ok"]
    verdicts: dict[str, int] = {}
    for r in records:
        verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
    return {"requests": len(records), "verdicts": verdicts, "p50_s": percentile(latencies, 0.5),
            "p99_s": percentile(latencies, 0.99), "max_s": round(max(latencies), 3) if latencies else None}


# --- the run -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    began = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=FULL_S,
                        help="seconds of load; the schedule is scaled to it (default %(default)s)")
    parser.add_argument("--clients", type=int, default=4, help="steady clients (default %(default)s)")
    parser.add_argument("--flood-clients", type=int, default=6, help="clients of the flood (default %(default)s)")
    parser.add_argument("--faults", default="all", help="comma-separated fault names, or 'all' (default)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="largest max_new_tokens a client asks for")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each service")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' choices and the sampling seeds")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="deadline of every request: one that runs into it counts as lost (a hang)")
    parser.add_argument("--max-wall", type=float, default=MAX_WALL_S, help="hard limit of the whole run, seconds")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--history-out", type=Path, default=None, help="write every request's entry here (JSON)")
    parser.add_argument("--workdir", type=Path, default=None, help="models, hosts file, logs (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (always kept on failure)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = [name for name, _, _ in SCHEDULE]
    chosen = names if args.faults == "all" else [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := [f for f in chosen if f not in names]:
        parser.error(f"unknown faults {unknown}: choose from {', '.join(names)}")
    if not 0 < args.duration <= args.max_wall - 120:
        parser.error(f"--duration must be in (0, {args.max_wall - 120:g}] (the run stops by itself within --max-wall)")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="specdec-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    hosts_path = workdir / "hosts.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "SPECDEC_CHAOS_HOSTS": str(hosts_path)}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    startup_timeout_s = 180.0
    instances: list[ChaosProcess] = []
    services: dict[str, ChaosProcess] = {}
    result: dict | None = None
    code = 1
    try:
        import torch

        torch.set_num_threads(max(1, args.threads))
        from specdec.models import load_model, max_context
        from tests.factories import make_tiny_model, make_tiny_tokenizer, save_model_dir

        tokenizer = make_tiny_tokenizer()
        target_spec = str(save_model_dir(workdir / "target", make_tiny_model(tokenizer, seed=0, layers=2), tokenizer))
        wrong_spec = str(save_model_dir(workdir / "wrong", make_tiny_model(tokenizer, seed=7, layers=2), tokenizer))
        draft_spec = str(save_model_dir(workdir / "draft", make_tiny_model(tokenizer, seed=1, layers=1, hidden=32),
                                        tokenizer))
        model, tokenizer = load_model(target_spec)
        context = max_context(model)
        hosts = Hosts(hosts_path, {TARGETS: [IPS["t1"], IPS["t2"]], DRAFTS: [IPS["d1"], IPS["d2"]]})

        target_port, draft_port = free_port(), free_port()
        common = ["--grace-period", "2"]
        coordinator_ports = {"c1": free_port(), "c2": free_port()}
        argvs: dict[str, list[str]] = {}
        for name in ("t1", "t2", "wrong"):
            argvs[name] = ["serve", "target", "--host", IPS[name], "--port", str(target_port),
                           "--model", wrong_spec if name == "wrong" else target_spec, *common]
        for name in ("d1", "d2"):
            argvs[name] = ["serve", "draft", "--host", IPS[name], "--port", str(draft_port), "--model", draft_spec,
                           *common]
        metrics_ports = {}
        for name, port in coordinator_ports.items():
            metrics_ports[name] = free_port()
            argvs[name] = ["serve", "coordinator", "--host", "127.0.0.1", "--port", str(port), "--http-port", "0",
                           "--metrics-port", str(metrics_ports[name]), *common,
                           "--target-addr", f"{TARGETS}:{target_port}", "--draft-addr", f"{DRAFTS}:{draft_port}",
                           "--tokenizer", target_spec, "--resolve-interval-s", "0.5",
                           "--worker-retries", "8", "--worker-timeout-s", "20",
                           "--hedge-percentile", "95", "--hedge-factor", "2", "--rate-limit", "0"]

        def make(name: str, suffix: str = "") -> ChaosProcess:
            argv = argvs[name]
            process = ChaosProcess(name + suffix, int(argv[argv.index("--port") + 1]), argv,
                                   workdir / f"{name}.log", env, host=argv[argv.index("--host") + 1],
                                   metrics_port=metrics_ports.get(name))
            instances.append(process)
            return process

        for name in argvs:
            services[name] = make(name)
            services[name].spawn()
        # One warm spare per restart the chosen faults make.
        spares: dict[str, list[ChaosProcess]] = {name: [] for name in argvs}
        for fault in chosen:
            for name in KILLS.get(fault, []):
                spare = make(name, f"#{len(spares[name]) + 2}")
                spare.spawn(warm=True)
                spares[name].append(spare)
        for service in services.values():
            service.wait_serving(startup_timeout_s)

        max_new = args.max_new_tokens
        greedy = {p: soak.reference_greedy(model, soak.chat_ids(tokenizer, p), max_new) for p in soak.PROMPTS}
        prompt_rng = random.Random(args.seed + 1)
        flood_prompts = [[prompt_rng.randrange(3, int(model.config.vocab_size))
                          for _ in range(context - FLOOD_NEW_TOKENS)] for _ in range(2)]
        flood = [(ids, soak.reference_greedy(model, ids, FLOOD_NEW_TOKENS)) for ids in flood_prompts]
        del model
        rng = random.Random(args.seed)
        keys = [(prompt, *params, rng.randrange(2**63)) for prompt in soak.PROMPTS[:3] for params in soak.SAMPLING]
        address = (f"ipv4:127.0.0.1:{coordinator_ports['c1']},127.0.0.1:{coordinator_ports['c2']}")

        async def baselines_then_chaos() -> dict:
            async with Client(f"127.0.0.1:{coordinator_ports['c1']}") as client:
                sampled = {}
                for key in keys:
                    request = soak.sampled_request(key, max_new)
                    request.disable_speculation = True
                    sampled[key] = list((await client.complete(request, timeout=args.request_timeout)).token_ids)
                for prompt in soak.PROMPTS:
                    request = make_request(prompt, max_new_tokens=max_new, speculate=False)
                    if list((await client.complete(request, timeout=args.request_timeout)).token_ids) != greedy[prompt]:
                        raise RuntimeError(f"before the faults, the services' greedy output for {prompt!r} differs "
                                           "from the model's own generate()")
            load = Load(greedy, sampled, flood, max_new, args.request_timeout)
            return await chaos(args, services, spares, hosts, load, address, chosen, startup_timeout_s)

        remaining = args.max_wall - (time.monotonic() - began) - 30.0
        try:
            outcome = asyncio.run(asyncio.wait_for(baselines_then_chaos(), timeout=max(remaining, 1.0)))
        except asyncio.TimeoutError:
            result = {"passed": False, "error": f"did not finish within --max-wall {args.max_wall:g} s"}
            code = 2
            return code
        crashed = [s.name for s in instances if not s.expected_exit and s.process is not None
                   and s.process.poll() is not None]
        for service in services.values():
            service.stop()
        result = report(args, outcome, crashed, instances)
        if args.history_out is not None:
            args.history_out.write_text(json.dumps(outcome["history"], indent=1) + "\n")
        code = 0 if result["passed"] else 1
    except Exception as exc:  # noqa: BLE001 - a set-up failure is reported like a failed run
        result = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        code = 1
    finally:
        for service in [*instances, *services.values()]:
            if service.alive():
                service.process.send_signal(signal.SIGCONT)
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


async def chaos(args, services, spares, hosts, load: Load, address: str, chosen: list[str],
                startup_timeout_s: float) -> dict:
    records: list[Record] = []
    in_flight: dict = {}
    t0 = time.monotonic()
    scale = args.duration / FULL_S
    stop_at = t0 + args.duration
    runner = Chaos(args, services, spares, hosts, scale, t0, startup_timeout_s)
    sampling = True

    async def sample_memory() -> None:
        while sampling:
            for service in list(services.values()):
                service.sample_memory()
            await asyncio.sleep(0.5)

    memory = asyncio.create_task(sample_memory())
    faults = [Fault(name, at, length) for name, at, length in SCHEDULE if name in chosen]
    fault_tasks = [asyncio.create_task(runner.run(fault)) for fault in faults]
    clients = [client_loop(address, i, args.seed, load, t0, stop_at, records, in_flight)
               for i in range(args.clients)]
    if "flood" in chosen:
        clients += [client_loop(address, 100 + i, args.seed, load, t0, stop_at, records, in_flight,
                                gate=runner.flooding) for i in range(args.flood_clients)]
    load_tasks = [asyncio.create_task(c) for c in clients]
    await asyncio.gather(*fault_tasks)
    # The load runs to its end; requests still running one deadline later are cut: unknown.
    done, pending = await asyncio.wait(load_tasks, timeout=max(0.0, stop_at - time.monotonic())
                                       + args.request_timeout + 5)
    unknown = [{"client": client_id, "invoked_s": round(at, 3)} for client_id, at in in_flight.values()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    sampling = False
    await memory
    for task in done:
        if task.exception() is not None:
            raise task.exception()
    return {"records": records, "faults": faults, "unknown": unknown, "elapsed_s": time.monotonic() - t0,
            "history": [history_entry(r) for r in sorted(records, key=lambda r: r.began_s)]
            + [{"client": u["client"], "invoked_s": u["invoked_s"], "verdict": "unknown"} for u in unknown]}


def history_entry(record: Record) -> dict:
    return {"client": record.client, "kind": record.kind, "label": record.label,
            "invoked_s": round(record.began_s, 3), "completed_s": round(record.ended_s, 3),
            "verdict": record.verdict, "code": record.code, "tokens": len(record.tokens),
            "resumes": record.resumes, "resyncs": record.resyncs,
            **({"details": record.details[:200]} if record.verdict != "ok" else {})}


def report(args, outcome: dict, crashed: list[str], instances: list[ChaosProcess]) -> dict:
    records: list[Record] = outcome["records"]
    faults: list[Fault] = outcome["faults"]
    counts = {verdict: sum(1 for r in records if r.verdict == verdict) for verdict in ("ok", "lost", "wrong")}
    refused = sum(1 for r in records if r.verdict == "refused")
    counts["unknown"] = len(outcome["unknown"])
    windows = [(f.began_s, f.ended_s) for f in faults if f.began_s is not None and f.ended_s is not None]
    per_fault = {}
    for fault in faults:
        if fault.began_s is None or fault.ended_s is None:
            continue
        during = [r for r in records if r.began_s < fault.ended_s and r.ended_s > fault.began_s]
        per_fault[fault.name] = {**fault.to_json(), **window_stats(during)}
    calm = [r for r in records if not any(r.began_s < end and r.ended_s > begin for begin, end in windows)]
    failed_faults = [f.name for f in faults if not f.to_json()["happened"]]
    wrong_weights = next((f for f in faults if f.name == "wrong-weights"), None)
    refusals_seen = wrong_weights is None or any(v > 0 for v in wrong_weights.details.get("refused_by", {}).values())
    passed = (counts["lost"] == 0 and counts["wrong"] == 0 and counts["unknown"] == 0 and not failed_faults
              and not crashed and refusals_seen and counts["ok"] > 0)
    bad = [r for r in records if r.verdict in ("lost", "wrong")]
    return {
        "passed": passed,
        "config": {"duration_s": args.duration, "clients": args.clients, "flood_clients": args.flood_clients,
                   "faults": [f.name for f in faults], "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                   "threads": args.threads},
        "elapsed_s": round(outcome["elapsed_s"], 3),
        "requests": len(records),
        **counts,
        "refused": refused,
        "by_kind": {kind: sum(1 for r in records if r.kind == kind) for kind in ("greedy", "sampled", "flood")},
        "resumes": sum(r.resumes for r in records),
        "resyncs": sum(r.resyncs for r in records),
        "latency_calm": window_stats(calm),
        "faults": per_fault,
        "faults_failed": failed_faults,
        "wrong_weights_refused": refusals_seen,
        "bad_examples": [history_entry(r) for r in bad[:5]],
        "unknown_examples": outcome["unknown"][:5],
        "crashed": crashed,
        "peak_rss_mib": {s.name: round(s.peak_rss_kib / 1024, 1) for s in instances if s.peak_rss_kib},
    }


if __name__ == "__main__":
    sys.exit(main())
