"""Serving in reduced precision (`--dtype`, specdec.runtime.precision): the flag and its
variable reach every worker's config; a worker loads its model, draft model or head in that
dtype and still computes logits in float32; greedy output through the services in bfloat16
equals the same bfloat16 model decoding alone, token by token, where both run the same
arithmetic (the buffered caches on CPU), and elsewhere (the paged pool, a GPU) differs from it
only at near-ties of its logits; float32 is served as before."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specdec import eagle
from specdec.client import Client, make_request
from specdec.config import DTYPES, WorkerConfig
from specdec.models import NGRAM, eos_token_ids, load_model
from specdec.runtime.paged_lm import PagedCausalLM
from specdec.runtime.precision import AUTO, TORCH_DTYPES, Fp32LMHead, serving_dtype, with_fp32_logits
from specdec.sessions import Session, SyncedContext
from specdec.train.teacher import chat_ids
from tests.factories import TEST_DEVICE, make_tiny_model, make_tiny_tokenizer, save_model_dir
from tests.harness import run, running_stack, worker_config
from tests.test_eagle_services import ALWAYS

PROMPTS = ["Explain how tides work.", "Summarise: the cat sat on the mat and slept. The cat sat on the mat.",
           "def add(a, b):\n    return a + b", "Héllo wörld — naïve café 🙂"]
MAX_NEW = 32
WORKER_COMMANDS = [["serve", "target"], ["serve", "draft"], ["up"]]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("dtype-models")
    target = make_tiny_model(tokenizer, seed=0).cpu()
    target_dir = save_model_dir(root / "target", target, tokenizer)
    draft_dir = save_model_dir(root / "draft", make_tiny_model(tokenizer, seed=1, layers=1, hidden=32).cpu(),
                               tokenizer)
    vocab = torch.arange(0, target.config.vocab_size, 2)
    torch.manual_seed(0)
    head = eagle.build(eagle.new_config(target, str(target_dir), len(vocab)), target, vocab)
    head_dir = root / "head"
    eagle.save(head, head_dir, dtype=torch.float32)
    return {"target": target_dir, "draft": draft_dir, "head": head_dir}


def bf16_reference(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target alone in bfloat16: loaded as a worker loads it, logits in float32, one full
    forward pass over the whole sequence per token (no cache, no drafts), greedy."""
    model, tokenizer = load_model(str(model_dir), dtype=torch.bfloat16, device=TEST_DEVICE)
    model, eos = with_fp32_logits(model), set(eos_token_ids(model, tokenizer))
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids], device=TEST_DEVICE)).logits[0, -1]  # [V]
            assert logits.dtype == torch.float32
            ids.append(int(torch.argmax(logits)))
            if ids[-1] in eos:
                break
    return ids[len(prompt_ids):]


# bfloat16 keeps 8 significant bits: two orders of the same arithmetic (the paged step against a
# full forward pass) round this model's logits apart by about a hundredth, and may swap two
# tokens whose logits are that close. A token further below the maximum is a wrong token.
NEAR_TIE = 0.03


def below_the_max(model, prompt_ids: list[int], output: list[int]) -> list[float]:
    """The bfloat16 target alone (`model`, loaded as bf16_reference loads it) fed `output`
    after the prompt: for each token of it that is not the argmax of the logits before it,
    how far its logit is below the maximum."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(prompt_ids) + list(output)], device=TEST_DEVICE)).logits[0]
    before = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(output)]  # [n, V]: the logits each token answers
    chosen = before.gather(1, torch.tensor(output, device=before.device)[:, None])[:, 0]
    gaps = before.max(-1).values - chosen
    return [float(g) for g in gaps if g > 0]


# --- the flag -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", WORKER_COMMANDS, ids=[" ".join(c) for c in WORKER_COMMANDS])
def test_dtype_flag_and_variable_reach_the_worker_config(command, monkeypatch, capsys):
    from specdec.cli import build_parser, flags

    def dtype(*argv: str) -> str:
        args = build_parser().parse_args([*command, *argv])  # variables are read as the parser is built
        return flags.worker_config(args, "model").dtype

    monkeypatch.delenv("SPECDEC_DTYPE", raising=False)
    assert dtype() == "auto" == WorkerConfig(model="m").dtype
    for name in DTYPES:
        assert dtype("--dtype", name) == name
    monkeypatch.setenv("SPECDEC_DTYPE", "bfloat16")
    assert dtype() == "bfloat16"
    assert dtype("--dtype", "float32") == "float32"  # a flag wins over its variable
    for argv, variable in ((["--dtype", "fp8"], None), ([], "half")):
        if variable is not None:
            monkeypatch.setenv("SPECDEC_DTYPE", variable)
        with pytest.raises(SystemExit) as exited:
            dtype(*argv)
        assert exited.value.code == 2
        assert "argument --dtype" in capsys.readouterr().err


def test_up_passes_dtype_to_the_draft_worker_it_spawns(monkeypatch):
    """`specdec up` runs a draft model in a child `specdec serve draft`: --dtype goes with it."""
    import asyncio

    from specdec.cli import build_parser, up

    seen = []

    async def fake_exec(*command, **kwargs):
        seen.append(list(command))
        raise RuntimeError("stop here")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    args = build_parser().parse_args(["up", "--draft", "some-draft", "--dtype", "float16"])
    with pytest.raises(RuntimeError, match="stop here"):
        run(up._start_draft(args, Path("/certs"), Path("/certs/ca.pem")))
    command = seen[0]
    assert command[command.index("serve") + 1] == "draft"
    assert command[command.index("--dtype") + 1] == "float16"


def test_dtype_names_resolve_per_device():
    assert set(DTYPES) == {AUTO, *TORCH_DTYPES}
    assert serving_dtype("auto", "cpu") == torch.float32
    assert serving_dtype("auto", "cuda") == serving_dtype("auto", "cuda:1") == torch.bfloat16
    assert serving_dtype("float16", "cpu") == torch.float16
    assert serving_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ValueError, match="not one of"):
        serving_dtype("fp8", "cpu")


# --- the workers load in the dtype and compute logits in float32 ---------------------------


def not_bf16_values(logits: torch.Tensor) -> bool:
    """Whether some logit is not a bfloat16 number: logits rounded to bfloat16 all are."""
    return bool((logits != logits.bfloat16().float()).any())


# The KV designs a worker serves with: "auto" is the buffered caches on CPU and the paged pool
# on a GPU, so on CPU the paged pool is asked for by name — the GPU's arithmetic, on CPU.
KV_CACHES = ["auto", "paged"]


@pytest.mark.parametrize("kv_cache", KV_CACHES)
@pytest.mark.parametrize("fast_path", [True, False], ids=["cpu-fast-path", "as-loaded"])
def test_a_target_worker_in_bfloat16_has_bf16_weights_and_fp32_logits(model_dirs, fast_path, kv_cache):
    from target_worker import service

    config = dataclasses.replace(worker_config(str(model_dirs["target"])), dtype="bfloat16", device=TEST_DEVICE,
                                 cpu_fast_path=fast_path, kv_cache=kv_cache)
    servicer = service.build_servicer(config)
    lm = servicer.verifier.lm
    assert servicer._info.dtype == "bfloat16"
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    assert isinstance(lm.model.get_output_embeddings(), Fp32LMHead)
    assert lm.bytes_per_token == 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads of 16, 2 bytes

    ids = [5, 17, 42, 99, 7, 3]
    session = Session("s")  # a new session's cache, whichever KV design the worker serves with
    fed = lm.prepare(SyncedContext(session, ids, 0), reuse_prefix=False)
    assert fed == ids
    logits = lm.feed(session, ids, len(ids))  # [n, V]
    assert logits.dtype == torch.float32
    assert not_bf16_values(logits)
    # The final projection of the bfloat16 model's own hidden states, in float32.
    plain, _ = load_model(str(model_dirs["target"]), dtype=torch.bfloat16, device=TEST_DEVICE)
    with torch.inference_mode():
        hidden = plain.model(input_ids=torch.tensor([ids], device=TEST_DEVICE)).last_hidden_state[0]
        expected = hidden.float() @ plain.lm_head.weight.float().T
    torch.testing.assert_close(logits, expected, atol=0.05 * float(expected.abs().max()), rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    if not fast_path and TEST_DEVICE == "cpu" and not isinstance(lm, PagedCausalLM):
        # The model as loaded, run the same way (the buffered caches): the same arithmetic.
        assert torch.equal(logits, expected)


def test_a_draft_worker_in_bfloat16_loads_its_model_and_head_in_bf16(model_dirs):
    from draft_worker import service

    for spec, fast_path in ((model_dirs["draft"], True), (model_dirs["head"], False)):
        config = dataclasses.replace(worker_config(str(spec)), dtype="bfloat16", device=TEST_DEVICE,
                                     cpu_fast_path=fast_path)
        servicer = service.build_servicer(config)
        assert servicer._info.dtype == "bfloat16", spec
    drafter = servicer.proposer.drafter  # the head, as loaded (no packed copy)
    head = drafter.head
    assert head.fc.weight.dtype == head.embed.dtype == torch.bfloat16
    assert head.embed.device.type == torch.device(TEST_DEVICE).type
    # Its draft-vocabulary rows of the target's LM head stay float32: logits in float32.
    assert head.head.dtype == head.inv_freq.dtype == torch.float32
    with torch.inference_mode():
        features = torch.randn(3, head.config.hidden_size, device=head.embed.device)
        predicted = head.extend(head.new_cache(), features, [1, 2, 3])  # [3, H]
        logits = head.logits(predicted)  # [3, Vd]
    assert predicted.dtype == torch.bfloat16
    assert logits.dtype == torch.float32 and not_bf16_values(logits)
    torch.testing.assert_close(logits, predicted.float() @ head.head.T)


def test_the_inline_head_takes_the_target_dtype(model_dirs):
    from target_worker import service

    config = dataclasses.replace(worker_config(str(model_dirs["target"])), dtype="bfloat16", device=TEST_DEVICE,
                                 head=str(model_dirs["head"]), cpu_fast_path=False)
    servicer = service.build_servicer(config)
    head = servicer.verifier.head.drafter.head
    assert servicer._info.head and servicer._info.dtype == "bfloat16"
    assert head.fc.weight.dtype == torch.bfloat16 and head.head.dtype == torch.float32


def test_float32_is_served_as_before(model_dirs, tokenizer):
    from target_worker import service

    model = make_tiny_model(tokenizer, seed=0)
    assert with_fp32_logits(model) is model  # nothing changes for a float32 model
    config = worker_config(str(model_dirs["target"]))
    assert serving_dtype(config.dtype, config.device) == torch.float32  # the default on CPU
    servicer = service.build_servicer(config)
    assert servicer._info.dtype == "float32"
    assert not any(isinstance(m, Fp32LMHead) for m in servicer.verifier.lm.model.modules())


# --- greedy through the services in bfloat16 ------------------------------------------------


def load_bf16(model_dir):
    return load_model(str(model_dir), dtype=torch.bfloat16, device=TEST_DEVICE)[0]


@pytest.mark.parametrize("kv_cache", KV_CACHES)
@pytest.mark.parametrize("drafter", ["target-itself", NGRAM, "head-on-target"])
def test_bf16_greedy_through_the_services_equals_bf16_target_alone(drafter, kv_cache, model_dirs, tokenizer,
                                                                   monkeypatch):
    """Target (and as the draft model, the target itself) loaded in bfloat16 and handed to their workers (loading by spec
    in --dtype: the tests above), and so is a head (eagle.load in bfloat16). Compared, token for token: the output with speculation (k = 4),
    the output of the same stack with speculation off, and the bfloat16 target alone decoding
    one token per full forward pass (bf16_reference) — or, where the stack's arithmetic is not
    the reference's (the paged pool, a GPU), each token of either output against the
    reference's logits on that output's own prefix: the argmax, or within NEAR_TIE of it."""
    monkeypatch.setenv("SPECDEC_KV_CACHE", kv_cache)  # read by the test stack's worker configs
    target = load_bf16(model_dirs["target"])
    draft = head = None
    if drafter == "target-itself":  # every draft accepted: whole blocks verified in one pass
        draft = load_bf16(model_dirs["target"])
    elif drafter == NGRAM:
        draft = NGRAM
    else:
        head = eagle.load(model_dirs["head"], target=target, dtype=torch.bfloat16)

    async def scenario():
        async with running_stack(target, tokenizer, draft=draft, target_head=head,
                                 target_options=ALWAYS if head is not None else None) as stack:
            assert stack.target_servicer._info.dtype == "bfloat16"
            paged = isinstance(stack.target_servicer.verifier.lm, PagedCausalLM)
            async with Client(stack.address) as client:
                speculative = [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4)) for p in PROMPTS]
                plain = [await client.complete(make_request(p, max_new_tokens=MAX_NEW, speculate=False))
                         for p in PROMPTS]
            return speculative, plain, paged

    speculative, plain, paged = run(scenario())
    assert sum(r.stats["proposed"] for r in speculative) > 0
    if drafter == "target-itself":
        assert all(r.stats["acceptance_rate"] == 1.0 for r in speculative)
    exact = TEST_DEVICE == "cpu" and not paged
    reference = None if exact else with_fp32_logits(load_bf16(model_dirs["target"]))
    eos = set(eos_token_ids(load_bf16(model_dirs["target"]), tokenizer))
    for prompt, fast, slow in zip(PROMPTS, speculative, plain):
        prompt_ids = chat_ids(tokenizer, prompt)
        if exact:  # the buffered caches on CPU: the reference's own arithmetic
            expected = bf16_reference(model_dirs["target"], prompt_ids, MAX_NEW)
            assert slow.token_ids == expected, prompt
            assert fast.token_ids == expected, prompt
        else:  # another order of bfloat16 arithmetic: a token may differ from the reference's only at a near-tie
            for output in (slow.token_ids, fast.token_ids):
                assert len(output) == MAX_NEW or output[-1] in eos
                assert max(below_the_max(reference, prompt_ids, output), default=0.0) <= NEAR_TIE, prompt


def test_up_starts_a_draft_models_process_before_it_serves_anything(monkeypatch):
    """The child is forked while this process has no gRPC thread yet (gRPC skips its fork
    handlers when its threads run, and the child can abort), and stopped when `up` fails."""
    from specdec.cli import build_parser, up
    from target_worker import service as target_service

    order = []

    class Child:
        returncode = None

    async def start_draft(*args):
        order.append("draft process")
        return Child()

    async def serve(config):
        order.append("target server")
        raise RuntimeError("stop here")

    async def stop_child(child):
        order.append("draft stopped")

    monkeypatch.setattr(up, "_start_draft", start_draft)
    monkeypatch.setattr(up, "_stop_child", stop_child)
    monkeypatch.setattr(target_service, "serve", serve)
    args = build_parser().parse_args(["up", "--draft", "some-draft", "--port", "0"])
    with pytest.raises(RuntimeError, match="stop here"):
        run(up.run(args))
    assert order == ["draft process", "target server", "draft stopped"]
