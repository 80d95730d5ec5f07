"""One bench run: every configuration on every prompt, alternating, so machine drift and
other users of the CPU hit all configurations alike.

Order: for each repeat, for each prompt, every configuration once, in an order rotated per
prompt and repeat (no configuration always runs first, right after a model switch). A run
during which other processes used more than `max_foreign_load` of the CPU is repeated (up to
`retries` times, waiting for a quiet second first); every run records the foreign load it
saw, so a reader can judge.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import torch

from specdec import eagle
from specdec.eagle.checkpoint import is_eagle_dir
from specdec.bench import machine
from specdec.runtime import costs
from specdec.bench.config import BenchConfig
from specdec.bench.peers import hf_generate
from specdec.bench.prompts import Prompt
from specdec.bench.services import SpecdecUp
from specdec.models import NGRAM, eos_token_ids, load_model

# Configuration numbers as the issue names them: (1) HF target alone, (2) HF assisted with
# the same drafter, (3) specdec with speculation off, (4) specdec with a drafter.
HF_GENERATE = "hf_generate"
HF_PROMPT_LOOKUP = "hf_prompt_lookup"
HF_ASSISTED_DRAFT = "hf_assisted_draft"
SPECDEC_TARGET_ONLY = "specdec_target_only"
SPECDEC_NGRAM = "specdec_ngram"
SPECDEC_DRAFT = "specdec_draft"
# A head with its alternatives switched off (`--min-alt-prob 1`): what they add, side by side.
SPECDEC_DRAFT_CHAIN = "specdec_draft_chain"
CHAIN_ONLY_ARGS = ("--min-alt-prob", "1")
FAST_SUFFIX = "_fastpath"
BASELINE = HF_GENERATE


@dataclass(frozen=True)
class Configuration:
    name: str
    number: str  # "1", "2", "3", "4" as in the issue; "1f"/"2f": a peer on the fast-path model
    label: str
    drafter: str | None  # None: target alone; "ngram"; or a draft model spec
    up_args: tuple[str, ...] = ()  # extra `specdec up` flags of its stack


def configurations(config: BenchConfig) -> list[Configuration]:
    k = config.k
    out = [Configuration(HF_GENERATE, "1", "HF generate(), target alone", None),
           Configuration(HF_PROMPT_LOOKUP, "2", f"HF assisted, prompt lookup (k={k})", NGRAM)]
    head = bool(config.draft) and is_eagle_dir(config.draft)
    if config.draft and not head:  # HF assisted generation cannot run a feature-level head
        out.append(Configuration(HF_ASSISTED_DRAFT, "2", f"HF assisted, draft model (k={k})", config.draft))
    if config.fast_peers:
        out += [Configuration(HF_GENERATE + FAST_SUFFIX, "1f", "HF generate() on the fast-path model", None),
                Configuration(HF_PROMPT_LOOKUP + FAST_SUFFIX, "2f", f"HF prompt lookup (k={k}) on the fast-path model",
                              NGRAM)]
    out += [Configuration(SPECDEC_TARGET_ONLY, "3", "specdec, no speculation", None),
            Configuration(SPECDEC_NGRAM, "4", f"specdec, n-gram (k≤{k}, adaptive)", NGRAM)]
    if config.draft:
        what = "EAGLE-style head on the target worker" if head else "draft model"
        out.append(Configuration(SPECDEC_DRAFT, "4", f"specdec, {what} (k≤{k}, adaptive)", config.draft))
        if head:
            out.append(Configuration(SPECDEC_DRAFT_CHAIN, "4", f"specdec, the same head, chain only (k≤{k}, "
                                     "--min-alt-prob 1)", config.draft, CHAIN_ONLY_ARGS))
    return out


@dataclass
class RunRecord:
    prompt: str
    kind: str
    configuration: str
    repeat: int
    token_ids: list[int]
    wall_s: float
    foreign_load: float
    attempts: int
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class BenchData:
    config: BenchConfig
    configurations: list[Configuration]
    machine: dict
    prompt_ids: dict[str, list[int]]
    runs: list[RunRecord]
    costs: dict[str, dict]  # prompt name -> measured costs


class Bench:
    def __init__(self, config: BenchConfig):
        self.config = config
        self.configs = configurations(config)
        torch.set_num_threads(config.threads)
        self.loop = asyncio.new_event_loop()
        self.model, self.tokenizer = load_model(config.target)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        from specdec.runtime.load import serving_lm

        self.serving = serving_lm(self.model)  # what the target worker serves: for c and v
        self.fast_model = self.serving.model if config.fast_peers else None
        self.draft_model = self.draft_serving = self.draft_head = None
        if config.draft and is_eagle_dir(config.draft):
            # As the draft worker serves it (packed weights on CPU): for c.
            self.draft_head = eagle.fast_cpu_head(eagle.load(config.draft, target=self.model))
        elif config.draft:
            self.draft_model, _ = load_model(config.draft)
            self.draft_serving = serving_lm(self.draft_model)
        self.stacks: dict[tuple[str, tuple[str, ...]], SpecdecUp] = {}  # (drafter, up_args) -> its stack

    def _pids(self) -> list[int]:
        return [os.getpid(), *(stack.pid for stack in self.stacks.values())]

    def start_services(self) -> None:
        self.stacks[NGRAM, ()] = SpecdecUp(self.config.target, NGRAM, self.config.k, self.config.threads, self.loop)
        for configuration in self.configs:
            key = (configuration.drafter, configuration.up_args)
            if configuration.name.startswith("specdec_") and configuration.drafter and key not in self.stacks:
                self.stacks[key] = SpecdecUp(self.config.target, configuration.drafter, self.config.k,
                                             self.config.threads, self.loop, list(configuration.up_args))

    def close(self) -> None:
        for stack in self.stacks.values():
            stack.close()
        self.loop.close()

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                                      add_generation_prompt=True)
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    def run_once(self, configuration: Configuration, prompt_ids: list[int], max_new_tokens: int):
        """(token ids, wall seconds, stats) of one generation."""
        name, k = configuration.name, self.config.k
        if name.startswith("hf_"):
            model = self.fast_model if name.endswith(FAST_SUFFIX) else self.model
            kwargs = {}
            if configuration.drafter == NGRAM:
                kwargs["prompt_lookup_k"] = k
            elif configuration.drafter is not None:
                kwargs.update(assistant=self.draft_model, assistant_k=k)
            run = hf_generate(model, prompt_ids, max_new_tokens, self.eos_ids, **kwargs)
        else:
            stack = self.stacks[configuration.drafter or NGRAM, configuration.up_args]
            run = stack.generate(prompt_ids, max_new_tokens, speculate=configuration.drafter is not None)
        return run.token_ids, run.wall_s, run.stats

    def timed(self, configuration: Configuration, prompt: Prompt, ids: list[int], repeat: int) -> RunRecord:
        attempts = 0
        while True:
            attempts += 1
            with machine.ForeignLoad(self._pids()) as load:
                tokens, wall, stats = self.run_once(configuration, ids, self.config.max_new_tokens)
            if load.fraction <= self.config.max_foreign_load or attempts > self.config.retries:
                return RunRecord(prompt.name, prompt.kind, configuration.name, repeat, tokens, wall,
                                 load.fraction, attempts, stats)
            machine.wait_for_quiet(self._pids(), self.config.max_foreign_load, timeout_s=60.0)

    def warm_up(self, ids: list[int]) -> None:
        for configuration in self.configs:
            self.run_once(configuration, ids, min(8, self.config.max_new_tokens))

    def measure_costs(self, prompt: Prompt, ids: list[int], output: list[int]) -> dict:
        """c and v on the serving path, at the context halfway through the generation;
        measured again, like a run, when other processes loaded the CPU meanwhile."""
        k = self.config.k
        context = ids + output[:len(output) // 2]
        for attempt in range(self.config.retries + 1):
            with machine.ForeignLoad(self._pids()) as load:
                target = costs.measure_target(self.serving, context, k)
            if load.fraction <= self.config.max_foreign_load:
                break
            machine.wait_for_quiet(self._pids(), self.config.max_foreign_load, timeout_s=60.0)
        ngram_s = costs.measure_ngram(context, k)
        measured = {
            "context_tokens": len(context), "k": k,
            "target_step_s": target.target_step_s, "verify_s": target.verify_s, "v": target.v,
            "ngram_lookup_s": ngram_s, "c_ngram": ngram_s / k / target.target_step_s,
            "foreign_load": load.fraction,
        }
        if self.draft_serving is not None or self.draft_head is not None:
            draft_s = (costs.measure_draft_model(self.draft_serving, context) if self.draft_serving is not None
                       else costs.measure_head(self.draft_head, context))
            measured.update(draft_step_s=draft_s, c_draft=draft_s / target.target_step_s)
        return measured

    def run(self) -> BenchData:
        prompts = self.config.prompts
        ids = {p.name: self.prompt_ids(p) for p in prompts}
        total = len(prompts) * len(self.configs) * self.config.repeats
        bar = _progress(total, self.config.progress)
        runs: list[RunRecord] = []
        try:
            self.start_services()
            bar.set_description("warm-up")
            self.warm_up(ids[prompts[0].name])
            for repeat in range(self.config.repeats):
                for index, prompt in enumerate(prompts):
                    shift = (index + repeat) % len(self.configs)
                    for configuration in self.configs[shift:] + self.configs[:shift]:
                        bar.set_description(f"{prompt.name} · {configuration.name}")
                        runs.append(self.timed(configuration, prompt, ids[prompt.name], repeat))
                        bar.update(1)
            bar.set_description("costs (c, v)")
            reference = {r.prompt: r.token_ids for r in runs if r.configuration == BASELINE and r.repeat == 0}
            measured = {p.name: self.measure_costs(p, ids[p.name], reference[p.name]) for p in prompts}
        finally:
            bar.close()
            self.close()
        return BenchData(self.config, self.configs, machine.describe(self.config.threads), ids, runs, measured)


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, text: str) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="run", dynamic_ncols=True)
