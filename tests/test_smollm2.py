"""The real SmolLM2-135M-Instruct through the three services: greedy output equals the
model's own `generate(do_sample=False)`, token for token, on varied prompts."""

from __future__ import annotations

import pytest

from specdec.client import Client, make_request
from specdec.models import NGRAM, load_model
from tests.harness import reference_greedy, run, running_stack

pytestmark = pytest.mark.slow

PROMPTS = {
    "grounded": "Summarise in one sentence: The Amazon rainforest covers much of the Amazon basin of South "
                "America. It is home to millions of species of insects, plants, birds and other forms of life, "
                "and its trees store a large share of the world's land carbon.",
    "open": "What is the capital of France, and why is it famous?",
    "code": "Write a Python function that returns the factorial of n.",
    "list": "List three primary colours.",
    "rewrite": "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
}
MAX_NEW = 32


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_smollm2_greedy_output_equals_target_alone(smollm2):
    model, tokenizer = smollm2

    async def scenario():
        async with running_stack(model, tokenizer, draft=NGRAM) as stack:
            async with Client(stack.address) as client:
                spec = {name: await client.complete(make_request(prompt, max_new_tokens=MAX_NEW, k=4))
                        for name, prompt in PROMPTS.items()}
                base = await client.complete(make_request(PROMPTS["grounded"], max_new_tokens=MAX_NEW,
                                                          speculate=False))
                return spec, base

    spec, base = run(scenario())
    for name, prompt in PROMPTS.items():
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True)["input_ids"])
        expected = reference_greedy(model, prompt_ids, MAX_NEW)
        assert spec[name].token_ids == expected, name
        assert spec[name].text == tokenizer.decode(expected, skip_special_tokens=True), name
        if name == "grounded":
            assert base.token_ids == expected
    # The n-gram drafter copies from a grounded prompt: speculation is doing work there.
    assert spec["grounded"].stats["accepted"] > 0


def test_the_shipped_distilled_draft_changes_speed_only(smollm2):
    """drafts/smollm2-135m-draft (trained by `specdec distill`) through the services: the
    output is the target's alone, and the draft's blocks are actually accepted."""
    from pathlib import Path

    model, tokenizer = smollm2
    draft, draft_tokenizer = load_model(str(Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-draft"))
    assert draft_tokenizer.get_vocab() == tokenizer.get_vocab()

    async def scenario():
        async with running_stack(model, tokenizer, draft=draft) as stack:
            async with Client(stack.address) as client:
                return {name: await client.complete(make_request(prompt, max_new_tokens=MAX_NEW, k=4))
                        for name, prompt in PROMPTS.items()}

    results = run(scenario())
    for name, prompt in PROMPTS.items():
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True)["input_ids"])
        assert results[name].token_ids == reference_greedy(model, prompt_ids, MAX_NEW), name
    assert sum(r.stats["accepted"] for r in results.values()) > 0


def test_the_shipped_eagle_head_changes_speed_only(smollm2):
    """specdec/drafts/smollm2-135m-eagle (a feature-level head trained by `specdec distill --kind
    eagle`) through the services, reading SmolLM2's hidden states: the output is the
    target's alone, and most of its draft tokens are accepted."""
    from pathlib import Path

    from specdec import eagle

    model, tokenizer = smollm2
    head = eagle.load("smollm2-135m-eagle", target=model)

    async def scenario():
        async with running_stack(model, tokenizer, draft=head) as stack:
            async with Client(stack.address) as client:
                return {name: await client.complete(make_request(prompt, max_new_tokens=MAX_NEW, k=4))
                        for name, prompt in PROMPTS.items()}

    results = run(scenario())
    for name, prompt in PROMPTS.items():
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True)["input_ids"])
        assert results[name].token_ids == reference_greedy(model, prompt_ids, MAX_NEW), name
    proposed = sum(r.stats["proposed"] for r in results.values())
    accepted = sum(r.stats["accepted"] for r in results.values())
    assert proposed > 0 and accepted / proposed > 0.2, (accepted, proposed)


@pytest.mark.parametrize("name", [None, "smollm2-135m-eagle3"], ids=["default", "eagle3"])
def test_the_committed_heads_on_the_target_worker_change_speed_only(smollm2, name):
    """The default draft of `specdec up` for SmolLM2 (specdec/drafts/smollm2-135m-eagle90, a head that
    also reads two of SmolLM2's middle layers, trained within 90 minutes all in), and the
    158-minute one (specdec/drafts/smollm2-135m-eagle3), run by the target worker as `specdec up` runs them: the
    output is the target's alone, most draft tokens are accepted, and the head's alternatives
    (tree leaves) are taken on real prompts."""
    from specdec import eagle, models

    model, tokenizer = smollm2
    spec = name or models.default_draft("smollm2-135m")
    head = eagle.load(spec, target=model)
    assert head.config.aux_layers  # reads more than the final hidden states

    async def scenario():
        async with running_stack(model, tokenizer, target_head=head) as stack:
            async with Client(stack.address) as client:
                return {name: await client.complete(make_request(prompt, max_new_tokens=MAX_NEW, k=4))
                        for name, prompt in PROMPTS.items()}

    results = run(scenario())
    for name, prompt in PROMPTS.items():
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True)["input_ids"])
        assert results[name].token_ids == reference_greedy(model, prompt_ids, MAX_NEW), name
    proposed = sum(r.stats["proposed"] for r in results.values())
    accepted = sum(r.stats["accepted"] for r in results.values())
    assert proposed > 0 and accepted / proposed > 0.3, (accepted, proposed)
    assert sum(r.stats["alternative_tokens"] for r in results.values()) > 0
