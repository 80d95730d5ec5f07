"""`specdec bench`: specdec measured against its peers, honestly, in one run.

Configurations, alternating per prompt (specdec.bench.runner): (1) Hugging Face `generate()`
with the target alone, (2) its assisted generation with the same drafter, (3) specdec through
the services with speculation off, (4) specdec with each drafter. Per configuration and
prompt kind (specdec.bench.prompts): tokens/s, speedups, acceptance, tokens per round, the
measured cost ratios c and v, the theoretical speedup and the fraction achieved
(specdec.runtime.costs, specdec.speedup, specdec.bench.report), and whether every greedy output equals (1).
"""
