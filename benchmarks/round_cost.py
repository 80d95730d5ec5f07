"""The split's own cost per round: what a round costs through the three services beyond the
target worker's step, measured with a model whose step is about a millisecond, so that the
cost is not hidden inside a long step (on a GPU an 8B step takes 3–8 ms).

    python benchmarks/round_cost.py                 # tiny random target, batch 1 and 16, ~2 min
    python benchmarks/round_cost.py --baseline /tmp/base   # also another checkout's coordinator

Side by side in one run, speculation off (one token per round, so a round is one step):

- **worker loop**: the target worker's own code (target_worker.service.build_servicer, its
  Verifier.verify_batch) called in this process, B sessions per step, one token each: the
  step as the worker runs it, with no gRPC, coordinator or client.
- **services**: `specdec serve target|draft|coordinator` as three processes on loopback
  (plaintext links), B clients streaming at once through specdec's gRPC client; the
  coordinator sends each step as a message on one stream per worker replica.
  The target worker runs each request's rounds ahead of the coordinator (`--run-ahead`,
  default 8: the coordinator sends one round in nine and commits the others as they stream in).
- **services (no run-ahead)**: the same workers behind a coordinator started with
  `--run-ahead 0`, which sends every round itself.
- **services (unary)**: the same workers behind a coordinator started with
  `--no-worker-streams`, which sends each step as a unary VerifyBatch call (no run-ahead).
- **up (mTLS)**: `specdec up` — coordinator and target worker in one process, the worker
  links on mutual TLS — the same clients.
- **services (baseline)**, with `--baseline DIR`: a coordinator run from another checkout
  (e.g. `git worktree add /tmp/base HEAD~1`) before the same workers, so a coordinator
  change is measured before/after in one run ("baseline / services" in the report); with
  `--baseline-workers` before a target and a draft worker run from that checkout too, for a
  worker change.

Per configuration: milliseconds per round after the first token (a client's time from its
first token to its last / its rounds after the first; the worker loop: per step), tokens/s
over all sessions, and the split's cost per round = services ms/round − worker ms/step. For a
coordinator in a process of its own (the services modes) also its CPU time per request-round
(all its threads, gRPC's included): what sizes a coordinator's CPU, whatever the worker's
device — one core carries 10⁶ / that many request-rounds per second (the OS counts CPU time
in 10 ms ticks: B × rounds ≥ 500 keeps that within a few percent). The clients' process
(this one) is read the same way, the target worker's by thread — its main thread (the event
loop: gRPC, the rounds run ahead, the answers, which run between one step and the next) and
its other threads (the model thread's steps, gRPC's own) — and the worker loop's own CPU per
round beside them (a step's CPU grows when other processes share its cores). On a machine
where all of them share a few cores, their sum per step bounds how short a round can be.
Every process runs `--threads` torch threads. Writes --out/NAME.json and .md (--name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak import REPO, ServiceProcess, free_port  # noqa: E402
from specdec.bench.machine import describe  # noqa: E402
from specdec.bench.services import SpecdecUp  # noqa: E402
from specdec.client import Client, make_request  # noqa: E402

PROMPT = "Count slowly from one to one hundred, one number per line."
MODES = ("worker loop", "services", "services (no run-ahead)", "services (unary)", "up (mTLS)")
# Whose CPU time per request-round a services mode reads, where a round's cost goes: the target
# worker's main thread (its event loop: gRPC, the rounds run ahead, the answers) and its other
# threads (the model thread's steps, gRPC's own threads), the coordinator, the clients.
CPU_PARTS = ("target_loop", "target_threads", "coordinator", "client")
COORDINATORS = {"services": "coordinator", "services (no run-ahead)": "coordinator-lockstep",
                "services (unary)": "coordinator-unary", "services (baseline)": "coordinator-baseline"}


def worker_loop(model_dir: str, batch: int, rounds: int, threads: int) -> dict:
    """The target worker's Verifier, B sessions, one token per round: ms per step."""
    import torch

    from specdec.config import WorkerConfig
    from specdec.models import load_model
    from target_worker.service import build_servicer
    from target_worker.verify import Round

    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_dir)
    servicer = build_servicer(WorkerConfig(model=model_dir), model, tokenizer)
    verifier = servicer.verifier
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                add_generation_prompt=True)["input_ids"])
    held = [0] * batch
    pending = [prompt] * batch
    steps: list[float] = []
    cpu_began = 0.0
    for step in range(rounds + 1):
        if step == 1:  # the first is the prefill
            cpu_began = cpu_seconds(os.getpid())
        began = time.perf_counter()
        outcome = verifier.verify_batch([Round(f"s{i}", held[i], pending[i], []) for i in range(batch)])
        if step:
            steps.append(time.perf_counter() - began)
        for i, verdict in enumerate(outcome.results):
            held[i], pending[i] = verdict.cached_len, [verdict.next_token]
    cpu_s = cpu_seconds(os.getpid()) - cpu_began
    servicer.thread.shutdown()
    per_step = statistics.median(steps)
    return {"ms_per_round": 1e3 * per_step, "tokens_per_s": batch / per_step,
            "alone_cpu_us_per_round": 1e6 * cpu_s / (batch * rounds)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def thread_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time so far of a process's main thread, and of all its other threads together."""
    import psutil

    main = other = 0.0
    for thread in psutil.Process(pid).threads():
        seconds = thread.user_time + thread.system_time
        if thread.id == pid:
            main += seconds
        else:
            other += seconds
    return main, other


async def through(address: str, batch: int, rounds: int, coordinator_pid: int | None = None,
                  target_pid: int | None = None) -> dict:
    """B clients at once, speculation off, `rounds` tokens each: ms per round after the first;
    with coordinator_pid (and target_pid), that process's CPU time per request-round (after
    the warm-up), and the clients' (this process's)."""
    def cpu() -> dict[str, float]:
        if not coordinator_pid:
            return {}
        seconds = {"coordinator": cpu_seconds(coordinator_pid), "client": cpu_seconds(os.getpid())}
        if target_pid:
            seconds["target_loop"], seconds["target_threads"] = thread_cpu_seconds(target_pid)
        return seconds

    async with Client(address) as client:
        await client.complete(make_request(PROMPT, max_new_tokens=4, speculate=False))  # warm-up
        cpu_began = cpu()

        async def one() -> tuple[float, int, float, float]:
            began, first, last, count = time.perf_counter(), None, None, 0
            async for response in client.stream(make_request(PROMPT, max_new_tokens=rounds, speculate=False)):
                now = time.perf_counter()
                if response.token_ids:
                    first = first or now
                    last, count = now, count + len(response.token_ids)
            return (last - first) / max(1, count - 1), count, began, last

        results = await asyncio.gather(*(one() for _ in range(batch)))
        cpu_s = {name: seconds - cpu_began[name] for name, seconds in cpu().items()}
    wall = max(r[3] for r in results) - min(r[2] for r in results)
    run = {"ms_per_round": 1e3 * statistics.median(r[0] for r in results),
           "tokens_per_s": sum(r[1] for r in results) / wall}
    for name, seconds in cpu_s.items():
        run[f"{name}_cpu_us_per_round"] = 1e6 * seconds / sum(r[1] for r in results)
    return run


def start_services(model_dir: str, threads: int, workdir: Path, baseline: Path | None = None,
                   baseline_workers: bool = False) -> dict[str, ServiceProcess]:
    """The two workers, and two coordinators in front of them: one sending steps on worker
    streams, one ("coordinator-unary") as unary calls; with `baseline`, a third
    ("coordinator-baseline") run from that source tree — before workers of its own, run from
    it too, with `baseline_workers`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    names = (("target", "draft", "coordinator", "coordinator-lockstep", "coordinator-unary")
             + (("coordinator-baseline",) if baseline else ())
             + (("target-baseline", "draft-baseline") if baseline and baseline_workers else ()))
    ports = {name: free_port() for name in names}
    common = ["--host", "127.0.0.1", "--grace-period", "1"]
    links = ["--target-addr", f"127.0.0.1:{ports['target']}", "--draft-addr", f"127.0.0.1:{ports['draft']}",
             "--tokenizer", model_dir, "--rate-limit", "0", "--http-port", "0"]
    argvs = {
        "target": ["serve", "target", "--port", str(ports["target"]), "--model", model_dir, *common],
        "draft": ["serve", "draft", "--port", str(ports["draft"]), "--model", "ngram", *common],
        "coordinator": ["serve", "coordinator", "--port", str(ports["coordinator"]), *common, *links],
        "coordinator-lockstep": ["serve", "coordinator", "--port", str(ports["coordinator-lockstep"]), *common,
                                 *links, "--run-ahead", "0"],
        "coordinator-unary": ["serve", "coordinator", "--port", str(ports["coordinator-unary"]), *common, *links,
                              "--no-worker-streams"],
    }
    if baseline is not None:
        base_links = links
        if baseline_workers:
            argvs["target-baseline"] = ["serve", "target", "--port", str(ports["target-baseline"]), "--model",
                                        model_dir, *common]
            argvs["draft-baseline"] = ["serve", "draft", "--port", str(ports["draft-baseline"]), "--model", "ngram",
                                       *common]
            base_links = ["--target-addr", f"127.0.0.1:{ports['target-baseline']}",
                          "--draft-addr", f"127.0.0.1:{ports['draft-baseline']}", *links[4:]]
        argvs["coordinator-baseline"] = ["serve", "coordinator", "--port", str(ports["coordinator-baseline"]),
                                         *common, *base_links]
    services = {name: ServiceProcess(name, ports[name], argvs[name], workdir / f"{name}.log", env,
                                     cwd=baseline if name.endswith("-baseline") else REPO) for name in argvs}
    for service in services.values():
        service.spawn()
    for service in services.values():
        service.wait_serving(120.0)
    return services


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (a random 2-layer model) or a model dir")
    parser.add_argument("--batches", default="1,16", help="comma-separated concurrencies")
    parser.add_argument("--rounds", type=int, default=64, help="tokens (rounds) per session")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats of each configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    parser.add_argument("--baseline", default=None,
                        help="another checkout whose coordinator also runs before the same workers")
    parser.add_argument("--baseline-workers", action="store_true",
                        help="with --baseline: the baseline coordinator talks to workers run from that checkout too")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="round-cost", help="file name of the record, without .json / .md")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="specdec-round-cost-"))
    model_dir = args.model
    if model_dir == "tiny":
        from tests.factories import make_tiny_model, make_tiny_tokenizer, save_model_dir

        tokenizer = make_tiny_tokenizer()
        model_dir = str(save_model_dir(workdir / "target", make_tiny_model(tokenizer, seed=0, layers=2,
                                                                            max_positions=512), tokenizer))
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    baseline = Path(args.baseline).resolve() if args.baseline else None
    modes = MODES + (("services (baseline)",) if baseline else ())
    services = start_services(model_dir, args.threads, workdir, baseline, args.baseline_workers)
    up = SpecdecUp(model_dir, "ngram", 4, args.threads, loop, extra_args=["--rate-limit", "0"])
    runs: list[dict] = []
    try:
        for batch in batches:
            for repeat in range(args.repeats):
                order = list(modes)
                if repeat % 2:
                    order.reverse()
                for mode in order:
                    if mode == "worker loop":
                        run = worker_loop(model_dir, batch, args.rounds, args.threads)
                    elif mode.startswith("services"):
                        coordinator = services[COORDINATORS[mode]]
                        target = services["target-baseline" if mode.endswith("(baseline)") and args.baseline_workers
                                          else "target"]
                        run = loop.run_until_complete(through(f"127.0.0.1:{coordinator.port}", batch, args.rounds,
                                                              coordinator.pid, target.pid))
                    else:
                        run = loop.run_until_complete(through(up.address, batch, args.rounds))
                    run.update(batch=batch, mode=mode)
                    runs.append(run)
                    cpu = ", ".join(f"{name} {run[f'{name}_cpu_us_per_round']:.0f}" for name in ("alone", *CPU_PARTS)
                                    if f"{name}_cpu_us_per_round" in run)
                    print(f"B={batch:>3} {mode:>16}: {run['ms_per_round']:.2f} ms/round, "
                          f"{run['tokens_per_s']:.0f} tok/s" + (f", CPU µs per request-round: {cpu}" if cpu else ""),
                          file=sys.stderr, flush=True)
    finally:
        up.close()
        for service in services.values():
            service.stop()
    summary: dict = {}
    for batch in batches:
        row = {mode: {key: statistics.median(r[key] for r in runs if r["batch"] == batch and r["mode"] == mode)
                      for key in ("ms_per_round", "tokens_per_s",
                                  *(f"{name}_cpu_us_per_round" for name in ("alone", *CPU_PARTS)))
                      if all(key in r for r in runs if r["batch"] == batch and r["mode"] == mode)}
               for mode in modes}
        for mode in modes[1:]:
            row[mode]["split_ms_per_round"] = row[mode]["ms_per_round"] - row["worker loop"]["ms_per_round"]
            row[mode]["vs_worker_loop"] = row[mode]["tokens_per_s"] / row["worker loop"]["tokens_per_s"]
        row["services"]["vs_unary_split"] = (row["services"]["split_ms_per_round"]
                                             / row["services (unary)"]["split_ms_per_round"])
        row["services"]["vs_no_run_ahead_tokens_per_s"] = (row["services"]["tokens_per_s"]
                                                           / row["services (no run-ahead)"]["tokens_per_s"])
        if baseline is not None:
            row["services"]["vs_baseline_split"] = (row["services"]["split_ms_per_round"]
                                                    / row["services (baseline)"]["split_ms_per_round"])
        summary[str(batch)] = row
    report = {"command": "python benchmarks/round_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": describe(args.threads), "config": vars(args) | {"model_dir": model_dir},
              "summary": summary, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# The split's cost per round — {report['machine'].get('cpu_model', '')}", "",
             f"`{report['command']}`; speculation off (one token per round), {args.rounds} rounds per session, "
             f"medians of {args.repeats} alternating repeats, {args.threads} torch thread(s) per process.", "",
             "Services: steps on one stream per worker replica, the target running each request's rounds ahead "
             "(`--run-ahead 8`); no run-ahead: the same workers behind a coordinator with `--run-ahead 0`; "
             "services (unary): behind one with `--no-worker-streams` (one VerifyBatch call per step).", "",
             "| B | worker loop ms/step | services ms/round | split ms/round | no run-ahead ms/round | "
             "split ms/round | services (unary) ms/round | "
             "split ms/round | up (mTLS) ms/round | split ms/round | services tok/s vs worker loop | "
             "services tok/s vs no run-ahead | coordinator CPU µs per request-round |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for batch, row in summary.items():
        lines.append(f"| {batch} | {row['worker loop']['ms_per_round']:.2f} | {row['services']['ms_per_round']:.2f} | "
                     f"{row['services']['split_ms_per_round']:+.2f} | "
                     f"{row['services (no run-ahead)']['ms_per_round']:.2f} | "
                     f"{row['services (no run-ahead)']['split_ms_per_round']:+.2f} | "
                     f"{row['services (unary)']['ms_per_round']:.2f} | "
                     f"{row['services (unary)']['split_ms_per_round']:+.2f} | {row['up (mTLS)']['ms_per_round']:.2f} | "
                     f"{row['up (mTLS)']['split_ms_per_round']:+.2f} | {row['services']['vs_worker_loop']:.2f} | "
                     f"{row['services']['vs_no_run_ahead_tokens_per_s']:.2f} | "
                     f"{row['services']['coordinator_cpu_us_per_round']:.0f} |")
    lines += ["", "Where a round's CPU goes (services, run-ahead): µs of CPU time per request-round — the worker "
              "loop's process (the step alone); the target worker's main thread (its event loop: gRPC, the rounds "
              "run ahead, the answers) and its other threads (the model thread's steps, gRPC's own threads); the "
              "coordinator; the clients (this process). Per step, their sum over the B rounds, to set against "
              "the services' ms per round times the cores they share.", "",
              "| B | worker loop | target, event loop | target, other threads | coordinator | clients | "
              "sum per step, ms | services ms/round |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for batch, row in summary.items():
        through_services, alone = row["services"], row["worker loop"]
        parts = [through_services[f"{name}_cpu_us_per_round"] for name in CPU_PARTS]
        lines.append(f"| {batch} | {alone['alone_cpu_us_per_round']:.0f} | "
                     + " | ".join(f"{part:.0f}" for part in parts)
                     + f" | {int(batch) * sum(parts) / 1e3:.2f} | {through_services['ms_per_round']:.2f} |")
    if baseline is not None:
        before = "its own workers, run from there too" if args.baseline_workers else "the same workers"
        lines += ["", f"Baseline: a coordinator run from `{baseline}` before {before}, steps on streams.", "",
                  "| B | services (baseline) ms/round | split ms/round | services split ms/round | split, this / baseline | "
                  "coordinator CPU µs per request-round, baseline / this | "
                  "target worker CPU µs per request-round, baseline / this |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for batch, row in summary.items():
            base, mine = row["services (baseline)"], row["services"]
            lines.append(f"| {batch} | {base['ms_per_round']:.2f} | {base['split_ms_per_round']:+.2f} | "
                         f"{mine['split_ms_per_round']:+.2f} | {mine['vs_baseline_split']:.2f} | "
                         f"{base['coordinator_cpu_us_per_round']:.0f} / {mine['coordinator_cpu_us_per_round']:.0f} | "
                         f"{base['target_loop_cpu_us_per_round'] + base['target_threads_cpu_us_per_round']:.0f} / "
                         f"{mine['target_loop_cpu_us_per_round'] + mine['target_threads_cpu_us_per_round']:.0f} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
