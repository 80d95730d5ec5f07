"""`specdec distill` on a tiny target: the teacher's batched generation is the target's own
greedy output, the hand-written loss has autograd's gradient, the simulated acceptance
counts rounds exactly, the bench prompts are never trained on, and a short run lowers the
loss, resumes from its checkpoint, and writes a directory that serves as a draft — through
the services and HF assisted generation — without changing the target's output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.train import losses as distill_losses
from specdec.train import prompts as distill_prompts
from specdec.train import self_prompts, teacher
from specdec.train.config import DistillConfig
from specdec.train.evaluate import simulate_rounds
from specdec.train.examples import collate_eagle, load_eagle_examples
from specdec.train.losses import topk_distill_loss
from specdec.bench.prompts import PROMPTS as BENCH_PROMPTS
from specdec.cli import main
from specdec.client import Client, make_request
from specdec.models import eos_token_ids, load_model, vocab_hash
from tests.factories import make_tiny_model, make_tiny_tokenizer, save_model_dir
from tests.harness import reference_greedy, run, running_stack

FIRST_STEPS = 40
TOTAL_STEPS = 80
LOG_EVERY = 10
MAX_NEW = 24
# A short run on a random tiny target: the loss must fall well below where it started.
LOSS_DROP = 0.8
SERVICE_PROMPTS = ["Explain how tides work.", "Write a haiku about rain.", "def add(a, b):"]


def tiny_run_args(target: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["distill", "--target", str(target), "--out", str(out), "--layers", "1", "--hidden", "32",
            "--intermediate", "64", "--train-prompts", "48", "--heldout-prompts", "8", "--samples-per-prompt", "2",
            "--max-new-tokens", str(MAX_NEW), "--gen-batch", "16", "--steps", str(steps), "--batch-size", "8",
            "--eval-every", "20", "--log-every", str(LOG_EVERY), "--checkpoint-every", "20", "--lr", "1e-2",
            "--warmup-steps", "5", "--threads", "2", "--no-progress", *extra]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return make_tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, target, tokenizer):
    """A run of FIRST_STEPS, then --resume to TOTAL_STEPS; what each left behind."""
    root = tmp_path_factory.mktemp("distill")
    target_dir = save_model_dir(root / "target", target, tokenizer)
    out = root / "draft"
    assert main(tiny_run_args(target_dir, out, FIRST_STEPS)) == 0
    work = out.with_name(out.name + ".work")
    shards = {p.name: p.stat().st_mtime_ns for p in (work / "data").iterdir()}
    first = json.loads((out / "distill.json").read_text())
    assert main(tiny_run_args(target_dir, out, TOTAL_STEPS, "--resume")) == 0
    second = json.loads((out / "distill.json").read_text())
    return {"target_dir": target_dir, "out": out, "work": work, "shards": shards, "first": first, "second": second}


def test_bench_prompts_are_in_neither_split():
    built = distill_prompts.build_prompts()
    texts = {p.text for p in built}
    for prompt in BENCH_PROMPTS:
        assert distill_prompts.excluded(prompt.text), f"no EXCLUDED pattern covers bench prompt {prompt.name}"
        assert prompt.text not in texts
    assert not [p.text for p in built if distill_prompts.excluded(p.text)]


def test_heldout_subjects_are_not_training_subjects():
    built = distill_prompts.build_prompts()
    train = {(p.kind, p.subject) for p in built if p.split == distill_prompts.TRAIN}
    heldout = {(p.kind, p.subject) for p in built if p.split == distill_prompts.HELDOUT}
    assert heldout and train and not train & heldout


def test_topk_distill_loss_has_autograd_gradient():
    torch.manual_seed(0)
    rows, vocab, k = 7, 53, 5
    logits = torch.randn(rows, vocab, dtype=torch.float64, requires_grad=True)  # [N, V]
    ids = torch.stack([torch.randperm(vocab)[:k] for _ in range(rows)])  # [N, K], distinct per row
    probs = torch.softmax(torch.randn(rows, k, dtype=torch.float64), -1)  # [N, K]
    upstream_soft, upstream_hard = torch.rand(rows, dtype=torch.float64), torch.rand(rows, dtype=torch.float64)

    soft, hard = topk_distill_loss(logits, ids, probs)
    ((soft * upstream_soft).sum() + (hard * upstream_hard).sum()).backward()
    ours = logits.grad.clone()
    logits.grad = None
    logq = torch.log_softmax(logits, -1)  # [N, V]
    ref_soft = -(probs * logq.gather(1, ids)).sum(-1)
    ref_hard = -logq.gather(1, ids[:, :1])[:, 0]
    ((ref_soft * upstream_soft).sum() + (ref_hard * upstream_hard).sum()).backward()

    torch.testing.assert_close(soft, ref_soft)
    torch.testing.assert_close(hard, ref_hard)
    torch.testing.assert_close(ours, logits.grad)


def test_simulated_rounds_commit_accepted_plus_one():
    agree = [True, True, True, True, False, True, False, True, True]
    # round 1 at 0: 4 accepted, bonus at 4 -> 5; round 2 at 5: 1 accepted, correction at 6
    # -> 7; round 3 at 7: 2 left, both accepted -> done.
    assert simulate_rounds(agree, 4) == (3, 10, 7)
    assert simulate_rounds([False] * 3, 4) == (3, 3 + 2 + 1, 0)
    assert simulate_rounds([], 4) == (0, 0, 0)


def test_teacher_generation_equals_target_greedy_alone(target, tokenizer):
    texts = ["Hi", "Write a long poem about the quick brown fox.", "def add(a, b):", "Summarise: the cat sat."]
    prompts = [teacher.chat_ids(tokenizer, t) for t in texts]  # different lengths: left padding
    model, cache = teacher.teacher_for_generation(target)
    first = teacher.teacher_generate(model, prompts, pad_id=tokenizer.pad_token_id, eos_ids=[], max_new_tokens=MAX_NEW,
                                      top_k=4, new_cache=cache)
    # Make an early token of row 0 the end-of-sequence id, so rows finish at different
    # steps and the batch is compacted mid-generation.
    eos = [first.answers[0][2]]
    result = teacher.teacher_generate(model, prompts, pad_id=tokenizer.pad_token_id, eos_ids=eos,
                                       max_new_tokens=MAX_NEW, top_k=4, new_cache=cache)
    assert len(result.answers[0]) <= 3
    for prompt, answer, ids, logprobs in zip(prompts, result.answers, result.topk_ids, result.topk_logprobs):
        assert answer == reference_greedy(target, prompt, MAX_NEW, eos_ids=eos)
        assert ids[:, 0].tolist() == answer  # greedy: the chosen token is the teacher's top-1
        assert bool((logprobs[:, :-1] >= logprobs[:, 1:]).all())


def test_generation_captures_aux_layers_as_a_teacher_forced_pass_would(target, tokenizer):
    """The layer states stored while the teacher generates (KV-cached decode steps, rows
    compacted as they finish) are what teacher.extract_aux computes teacher-forced."""
    texts = ["Hi", "Write a long poem about the quick brown fox.", "def add(a, b):", "Summarise: the cat sat."]
    prompts = [teacher.chat_ids(tokenizer, t) for t in texts]
    model, cache = teacher.teacher_for_generation(target)
    first = teacher.teacher_generate(model, prompts, pad_id=tokenizer.pad_token_id, eos_ids=[], max_new_tokens=MAX_NEW,
                                      top_k=4, new_cache=cache)
    eos = [first.answers[0][2]]  # row 0 finishes early: the batch is compacted
    result = teacher.teacher_generate(model, prompts, pad_id=tokenizer.pad_token_id, eos_ids=eos,
                                       max_new_tokens=MAX_NEW, top_k=4, new_cache=cache, features=True,
                                       aux_layers=(1, 0))
    assert result.answers == teacher.teacher_generate(model, prompts, pad_id=tokenizer.pad_token_id, eos_ids=eos,
                                                       max_new_tokens=MAX_NEW, top_k=4, new_cache=cache).answers
    assert not model.model.layers[0]._forward_hooks  # the capture hooks are gone
    sequences = [(p + a)[:-1] for p, a in zip(result.prompts, result.answers)]
    forced = teacher.aux_states(target, sequences, (1, 0))
    hidden = target.config.hidden_size
    for got, want, feats, seq in zip(result.aux, forced, result.features, sequences):
        assert got.shape == want.shape == (len(seq), 2 * hidden) and feats.shape == (len(seq), hidden)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-4)  # states ~2e-2
        assert not torch.equal(got[:, :hidden], got[:, hidden:])  # layer 1, then layer 0


def test_an_aux_head_from_nothing_gets_its_layer_states_in_the_data_phase(tmp_path, target, tokenizer):
    target_dir = save_model_dir(tmp_path / "target", target, tokenizer)
    out = tmp_path / "head"
    assert main(tiny_run_args(target_dir, out, 4, "--kind", "eagle", "--draft-vocab", "96", "--aux-layers", "0")) == 0
    work = out.with_name(out.name + ".work")
    record = json.loads((out / "distill.json").read_text())
    assert record["data"]["aux_positions_computed"] == 0  # none needed a teacher-forced pass
    assert sorted(p.name for p in (work / "aux-0").iterdir()) == sorted(p.name for p in (work / "data").iterdir())
    shard = torch.load(next((work / "data").iterdir()), weights_only=True)
    assert "aux" not in shard  # stored beside the shard, not in it


def test_aux_layers_the_target_lacks_are_refused_before_any_data(tmp_path, target, tokenizer, capsys):
    target_dir = save_model_dir(tmp_path / "target", target, tokenizer)
    out = tmp_path / "head"
    assert main(tiny_run_args(target_dir, out, 4, "--kind", "eagle", "--aux-layers", "7")) != 0
    assert "layer" in capsys.readouterr().err
    assert not (out.with_name(out.name + ".work") / "data").exists()


def test_users_prompts_are_added_to_the_training_prompts(tmp_path, target, tokenizer):
    """--prompts FILE: the user's prompts are answered and trained on after the built-in ones
    (duplicates and bench subjects dropped); the data's identity covers them."""
    target_dir = save_model_dir(tmp_path / "target", target, tokenizer)
    builtin = [p.text for p in distill_prompts.split(distill_prompts.build_prompts(), "train")][:4]
    mine = ["Summarise this support ticket: the printer jams.", "Translate 'good morning' to French.",
            "Write a SQL query that counts users per country."]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in
                                 [mine[0], builtin[0], "", mine[1], "What is the capital of France?", mine[2], mine[0]]
                                 if t) + "\n\n")
    out = tmp_path / "draft"
    args = tiny_run_args(target_dir, out, 2, "--prompts", str(prompts))
    args[args.index("--train-prompts") + 1] = "4"
    assert main(args) == 0
    work = out.with_name(out.name + ".work")
    answered = set()
    for path in (work / "data").glob("*-train-s0.pt"):
        answered.update(tuple(p) for p in torch.load(path, weights_only=True)["prompts"])
    assert answered == {tuple(teacher.chat_ids(tokenizer, t)) for t in builtin + mine}
    assert json.loads((out / "distill.json").read_text())["data"]["train_prompts"] == 7
    # Other prompts are other data: a resume with them is refused.
    prompts.write_text(json.dumps({"prompt": mine[0]}) + "\n")
    assert main(args + ["--resume"]) != 0


def test_self_written_prompts_are_answered_after_the_built_in_ones(tmp_path, target, tokenizer):
    """--self-prompts N: the target's own requests (stored in the work dir before any
    shard) are answered and trained on after the built-in prompts; the count is part of
    the data's identity, and a negative one is refused."""
    target_dir = save_model_dir(tmp_path / "target", target, tokenizer)
    out = tmp_path / "draft"
    args = tiny_run_args(target_dir, out, 2, "--self-prompts", "40")
    args[args.index("--train-prompts") + 1] = "4"
    assert main(args) == 0
    work = out.with_name(out.name + ".work")
    written = self_prompts.read_self_prompts(work)
    summary = json.loads((out / "distill.json").read_text())["data"]["self_prompts"]
    assert summary["kept"] == len(written) and summary["sampled"] >= 16
    assert summary["kept"] + sum(summary["dropped"].values()) == summary["sampled"]
    builtin = [p.text for p in distill_prompts.split(distill_prompts.build_prompts(), "train")][:4]
    answered = set()
    for path in (work / "data").glob("*-train-s0.pt"):
        answered.update(tuple(p) for p in torch.load(path, weights_only=True)["prompts"])
    assert answered == {tuple(teacher.chat_ids(tokenizer, t)) for t in builtin + written}
    assert main(args + ["--resume"]) == 0  # the stored requests are reused, not rewritten
    assert self_prompts.read_self_prompts(work) == written
    args[args.index("--self-prompts") + 1] = "41"
    assert main(args + ["--resume"]) != 0
    args[args.index("--self-prompts") + 1] = "-1"
    assert main(args + ["--out", str(tmp_path / "other")]) != 0  # a fresh work dir, refused before any data
    assert not (tmp_path / "other.work" / "data").exists()


@pytest.fixture(scope="module")
def teacher_dtypes(tmp_path_factory, target, tokenizer):
    """--teacher-dtype float32, then bfloat16, on the same prompts: each run's record and
    greedy (sample 0) shards, and the bfloat16 run's arguments. A bfloat16 teacher (faster
    on CPUs with bf16 dot products) answers the training prompts; held-out answers still
    come from the target as loaded, so agreement is measured against what is served."""
    root = tmp_path_factory.mktemp("teacher-dtype")
    target_dir = save_model_dir(root / "target", target, tokenizer)
    shards, records = {}, {}
    for dtype in ("float32", "bfloat16"):
        out = root / dtype
        args = tiny_run_args(target_dir, out, 2, "--teacher-dtype", dtype)
        assert main(args) == 0
        records[dtype] = json.loads((out / "distill.json").read_text())
        data = out.with_name(out.name + ".work") / "data"
        shards[dtype] = {p.name: torch.load(p, weights_only=True) for p in data.glob("*-s0.pt")}
    return {"shards": shards, "records": records, "args": args}


def _compare_teacher_shards(teacher_dtypes, split: str) -> None:
    shards = teacher_dtypes["shards"]
    assert shards["float32"].keys() == shards["bfloat16"].keys()
    names = [name for name in shards["float32"] if f"-{split}-" in name]
    assert names, f"no {split} shards"
    for name in names:
        fp32, bf16 = shards["float32"][name], shards["bfloat16"][name]
        assert bf16["prompts"] == fp32["prompts"]
        same = all(torch.equal(a, b) for a, b in zip(fp32["topk_logprobs"], bf16["topk_logprobs"]))
        assert same == ("-heldout-" in name), name  # bf16 log-probs differ from fp32's; held-out ones do not


def test_a_bfloat16_teacher_answers_the_training_prompts(teacher_dtypes):
    _compare_teacher_shards(teacher_dtypes, distill_prompts.TRAIN)


def test_the_served_target_answers_the_held_out_prompts_beside_a_bfloat16_teacher(teacher_dtypes):
    _compare_teacher_shards(teacher_dtypes, distill_prompts.HELDOUT)


def test_the_teacher_dtype_is_recorded(teacher_dtypes):
    for dtype, record in teacher_dtypes["records"].items():
        assert record["config"]["teacher_dtype"] == dtype


def test_the_teacher_dtype_is_part_of_the_datas_identity(teacher_dtypes):
    args = list(teacher_dtypes["args"])
    assert main(args + ["--resume"]) == 0
    args[args.index("--teacher-dtype") + 1] = "float32"
    assert main(args + ["--resume"]) != 0  # other data: refused


@pytest.mark.slow
def test_smollm2_writes_distinct_whole_requests_of_its_own(tmp_path):
    """Magpie-style requests from the real instruction-tuned target: each one a whole user
    message (ended by the end-of-turn token, no special tokens), distinct, off the bench's
    subjects and not one already taken; the prefix is how every chat of the target begins."""
    model, tokenizer = load_model("smollm2-135m")
    prefix = self_prompts.user_turn_prefix(tokenizer)
    assert teacher.chat_ids(tokenizer, "Hello there")[:len(prefix)] == prefix
    assert tokenizer.decode(prefix).endswith("user\n")
    config = DistillConfig(target="smollm2-135m", out_dir=tmp_path / "out", work_dir=tmp_path,
                           self_prompts=12, gen_batch=16)
    taken = {"Can you help me?"}
    summary = self_prompts.write_self_prompts(config, model, tokenizer, pad_id=tokenizer.pad_token_id,
                                              eos_ids=eos_token_ids(model, tokenizer), taken=taken,
                                              deadline=float("inf"))
    written = self_prompts.read_self_prompts(tmp_path)
    assert len(written) == summary["kept"] == 12  # SmolLM2 finishes most requests well inside the limit
    assert summary["kept"] + sum(summary["dropped"].values()) == summary["sampled"]
    assert len(set(written)) == 12 and not taken & set(written)
    assert all(len(t.split()) >= self_prompts.SELF_PROMPT_MIN_WORDS for t in written)
    assert not any(distill_prompts.excluded(t) for t in written)
    assert not any(s in t for t in written for s in tokenizer.all_special_tokens)
    # Real requests: most end as a question or an instruction would.
    assert sum(t.rstrip().endswith(("?", ".", "!")) for t in written) >= 8


@pytest.mark.parametrize("name, text, message", [
    ("p.jsonl", '{"prompt": "ok"}\n{"prompt": 3}\n', "p.jsonl:2"),
    ("p.jsonl", "not json\n", "p.jsonl:1: not JSON"),
    ("p.txt", "\n  \n", "no prompts"),
    ("absent.txt", None, "no such file"),
])
def test_a_bad_prompts_file_is_refused_with_its_line(tmp_path, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=message):
        distill_prompts.read_prompt_file(path)
    assert distill_prompts.read_prompt_file(_write(tmp_path / "ok.txt", "one\n\n two \n")) == ["one", "two"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_distill_lowers_the_loss(distilled):
    losses = [h["loss"] for h in distilled["second"]["history"] if "loss" in h]
    assert losses[-1] < LOSS_DROP * losses[0], losses


def test_resume_continues_from_checkpoint_without_regenerating_data(distilled):
    first, second = distilled["first"], distilled["second"]
    assert first["training"]["steps"] == FIRST_STEPS and second["training"]["steps"] == TOTAL_STEPS
    logged = [h["step"] for h in second["history"] if "loss" in h]
    assert logged == list(range(LOG_EVERY, TOTAL_STEPS + 1, LOG_EVERY))  # one history, no restart
    shards = {p.name: p.stat().st_mtime_ns for p in (distilled["work"] / "data").iterdir()}
    assert shards == distilled["shards"]
    assert second["training"]["tokens_seen"] > first["training"]["tokens_seen"]


def test_refuses_a_used_work_dir_without_resume(distilled, capsys):
    assert main(tiny_run_args(distilled["target_dir"], distilled["out"], TOTAL_STEPS)) == 2
    assert "--resume" in capsys.readouterr().err


def test_output_is_a_bf16_hf_dir_sharing_the_tokenizer(distilled, tokenizer):
    out = distilled["out"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    draft, draft_tokenizer = load_model(str(out))
    assert next(draft.parameters()).dtype == torch.float32  # workers load fp32
    assert vocab_hash(draft_tokenizer) == vocab_hash(tokenizer)
    assert draft.config.vocab_size == len(tokenizer)
    assert eos_token_ids(draft, draft_tokenizer) == [tokenizer.eos_token_id]
    assert distilled["second"]["final"]["heldout_positions"] > 0


def test_draft_through_the_services_is_token_identical_to_the_target(distilled, target, tokenizer):
    draft, _ = load_model(str(distilled["out"]))

    async def scenario():
        async with running_stack(target, tokenizer, draft=draft) as stack:
            async with Client(stack.address) as client:
                return [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4)) for p in SERVICE_PROMPTS]

    results = run(scenario())
    for text, result in zip(SERVICE_PROMPTS, results):
        assert result.token_ids == reference_greedy(target, teacher.chat_ids(tokenizer, text), MAX_NEW), text
    assert sum(r.stats["proposed"] for r in results) > 0  # the draft was asked


def test_draft_works_as_an_hf_assistant_model(distilled, target, tokenizer):
    draft, _ = load_model(str(distilled["out"]))
    ids = teacher.chat_ids(tokenizer, SERVICE_PROMPTS[0])
    with torch.inference_mode():
        assisted = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   assistant_model=draft, do_sample=False, max_new_tokens=MAX_NEW)
    assert assisted[0, len(ids):].tolist() == reference_greedy(target, ids, MAX_NEW)


def test_building_the_cli_parser_does_not_import_torch():
    code = "import sys, specdec.cli as c; c.build_parser(); sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ----------------------------------------------------------------------------- --kind eagle


@pytest.fixture(scope="module")
def distilled_eagle(tmp_path_factory, target, tokenizer):
    """A feature-level head (specdec.eagle) trained on the tiny target, in two invocations."""
    root = tmp_path_factory.mktemp("distill-eagle")
    target_dir = save_model_dir(root / "target", target, tokenizer)
    out = root / "head"
    extra = ("--kind", "eagle", "--draft-vocab", "96", "--unroll", "2", "--lr", "3e-3")
    assert main(tiny_run_args(target_dir, out, FIRST_STEPS, *extra)) == 0
    vocab = torch.load(out.with_name(out.name + ".work") / "draft_vocab.pt")
    assert main(tiny_run_args(target_dir, out, TOTAL_STEPS, "--resume", *extra)) == 0
    record = json.loads((out / "distill.json").read_text())
    return {"target_dir": target_dir, "out": out, "record": record, "vocab": vocab}


def test_eagle_distill_lowers_the_loss(distilled_eagle):
    record = distilled_eagle["record"]
    losses = [h["loss"] for h in record["history"] if "loss" in h]
    assert losses[-1] < LOSS_DROP * losses[0], losses


def test_eagle_distill_resumes_with_one_history(distilled_eagle):
    record = distilled_eagle["record"]
    assert record["training"]["steps"] == TOTAL_STEPS
    assert [h["step"] for h in record["history"] if "loss" in h] == list(range(LOG_EVERY, TOTAL_STEPS + 1, LOG_EVERY))


def test_eagle_record_describes_the_head(distilled_eagle):
    record = distilled_eagle["record"]
    assert record["kind"] == "eagle" and record["student"]["feature_bytes_per_token"] == 2 * 64


def test_eagle_record_has_the_draft_vocabularys_coverage(distilled_eagle):
    assert 0 < distilled_eagle["record"]["data"]["draft_vocab_coverage_train"] <= 1


def test_eagle_record_measures_the_served_head(distilled_eagle):
    record = distilled_eagle["record"]
    assert "sim_alpha" in record["final"] and record["cost"]["c"] > 0


@pytest.fixture(scope="module")
def bf16_logits_steps(distilled_eagle):
    """--bf16-logits only rounds the draft-vocabulary logits: (loss, gradient) of one batch
    with fp32 logits, then with bf16 ones, from the trained head."""
    from specdec import eagle

    work = distilled_eagle["out"].with_name(distilled_eagle["out"].name + ".work")
    examples = load_eagle_examples(work, distill_prompts.TRAIN)[:8]
    head = eagle.load(distilled_eagle["out"])
    vocab = distilled_eagle["vocab"]
    index_of = torch.full((int(head.embed.shape[0]),), -1, dtype=torch.long)
    index_of[vocab] = torch.arange(len(vocab))
    batch = collate_eagle(examples, 0, index_of, head.config.hidden_size)
    results = []
    for bf16_logits in (False, True):
        head.zero_grad(set_to_none=True)
        loss, _ = distill_losses.eagle_step_loss(head, batch, 2, 0.5, 1.0, True, bf16_logits)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])
        results.append((float(loss.detach()), grad))
    return results


def test_bf16_logits_give_the_fp32_loss_within_bf16_rounding(bf16_logits_steps):
    (loss32, _), (loss16, _) = bf16_logits_steps
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32)


def test_bf16_logits_give_the_fp32_gradient_within_bf16_rounding(bf16_logits_steps):
    """A wrong product or a dropped gradient is not within bf16 rounding."""
    (_, grad32), (_, grad16) = bf16_logits_steps
    assert float(torch.nn.functional.cosine_similarity(grad16, grad32, dim=0)) > 0.99
    assert grad16.shape == grad32.shape and float(grad16.abs().sum()) > 0


def _noisy_features_case():
    """--feature-noise on three H-wide states (final, then aux layers, whose scales differ by
    orders of magnitude) with zero rows (position 0, padding): (features, hidden, a, noisy)."""
    hidden, a = 16, 0.2
    torch.manual_seed(0)
    features = torch.randn(3, 40, 3 * hidden) * torch.tensor([1.0, 10.0, 300.0]).repeat_interleave(hidden)
    features[:, 0] = 0  # position 0
    features[2, 30:] = 0  # padding
    noisy = distill_losses.noisy_features(features, hidden, a, torch.Generator().manual_seed(5))
    return features, hidden, a, noisy


def test_feature_noise_repeats_with_its_seed():
    """The same generator seed gives the same noise (a resumed run repeats it)."""
    features, hidden, a, noisy = _noisy_features_case()
    assert torch.equal(noisy, distill_losses.noisy_features(features, hidden, a, torch.Generator().manual_seed(5)))
    assert not torch.equal(noisy, distill_losses.noisy_features(features, hidden, a, torch.Generator().manual_seed(6)))


def test_feature_noise_spares_empty_rows():
    features, _, _, noisy = _noisy_features_case()
    assert torch.equal(noisy[:, 0], features[:, 0]) and torch.equal(noisy[2, 30:], features[2, 30:])


def test_feature_noise_is_scaled_to_each_state():
    """U(-a, a) × the RMS of each H-wide state."""
    features, hidden, a, noisy = _noisy_features_case()
    segments = features.unflatten(-1, (3, hidden))
    rms = segments.pow(2).mean(-1, keepdim=True).sqrt()
    relative = ((noisy.unflatten(-1, (3, hidden)) - segments) / rms.clamp_min(1e-12))[rms.squeeze(-1) > 0]
    assert float(relative.abs().max()) <= a + 1e-5  # within ±a of each state's own scale
    assert abs(float(relative.std()) - a / 3 ** 0.5) < 0.01  # uniform on [-a, a]: std a/√3, on every state
    for s in range(3):
        assert abs(float(relative[:, s].std()) - a / 3 ** 0.5) < 0.02


def test_feature_noise_reaches_the_loss(distilled_eagle):
    from specdec import eagle

    work = distilled_eagle["out"].with_name(distilled_eagle["out"].name + ".work")
    head = eagle.load(distilled_eagle["out"])
    vocab = distilled_eagle["vocab"]
    index_of = torch.full((int(head.embed.shape[0]),), -1, dtype=torch.long)
    index_of[vocab] = torch.arange(len(vocab))
    batch = collate_eagle(load_eagle_examples(work, distill_prompts.TRAIN)[:8], 0, index_of, head.config.hidden_size)
    with torch.no_grad():
        clean, _ = distill_losses.eagle_step_loss(head, batch, 2, 0.5, 1.0, False)
        again, _ = distill_losses.eagle_step_loss(head, batch, 2, 0.5, 1.0, False, feature_noise=0.0)
        noisy, _ = distill_losses.eagle_step_loss(head, batch, 2, 0.5, 1.0, False, feature_noise=0.3,
                                                  generator=torch.Generator().manual_seed(1))
    assert float(clean) == float(again) and float(noisy) != float(clean)


def test_a_feature_noise_amplitude_out_of_range_is_refused(distilled_eagle, tmp_path, capsys):
    assert main(tiny_run_args(distilled_eagle["target_dir"], tmp_path / "h", 4, "--kind", "eagle",
                              "--feature-noise", "-1")) != 0
    assert "--feature-noise" in capsys.readouterr().err


def test_feature_noise_with_kind_model_is_refused(distilled_eagle, tmp_path, capsys):
    assert main(tiny_run_args(distilled_eagle["target_dir"], tmp_path / "d", 4, "--feature-noise", "0.1")) != 0
    assert "--kind eagle only" in capsys.readouterr().err


def test_eagle_output_loads_as_a_head_reading_its_target(distilled_eagle):
    from specdec import eagle

    out = distilled_eagle["out"]
    assert eagle.is_eagle_dir(str(out))
    head = eagle.load(out)  # loads the target by the spec the head recorded
    assert head.config.target == str(distilled_eagle["target_dir"])
    assert torch.equal(head.draft_vocab, distilled_eagle["vocab"])  # the resume kept the vocabulary
    assert (out / "README.md").read_text().startswith("# Draft for")


def test_eagle_head_through_the_services_is_token_identical(distilled_eagle, target, tokenizer):
    from specdec import eagle

    head = eagle.load(distilled_eagle["out"], target=target)

    async def scenario():
        async with running_stack(target, tokenizer, draft=head) as stack:
            async with Client(stack.address) as client:
                return [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4)) for p in SERVICE_PROMPTS]

    results = run(scenario())
    for text, result in zip(SERVICE_PROMPTS, results):
        assert result.token_ids == reference_greedy(target, teacher.chat_ids(tokenizer, text), MAX_NEW), text
    assert sum(r.stats["proposed"] for r in results) > 0


AUX_STEPS = 20


@pytest.fixture(scope="module")
def distilled_aux(tmp_path_factory, distilled_eagle):
    """A head that also reads target layer 0 (--aux-layers), warm-started from the trained
    head (--init-from) on the same teacher data."""
    import shutil

    root = tmp_path_factory.mktemp("distill-aux")
    source = distilled_eagle["out"].with_name(distilled_eagle["out"].name + ".work")
    work = root / "work"
    work.mkdir()
    shutil.copytree(source / "data", work / "data")
    for name in ("meta.json", "data.json", "draft_vocab.pt"):
        shutil.copy(source / name, work / name)
    out = root / "head"
    extra = ("--kind", "eagle", "--draft-vocab", "96", "--unroll", "2", "--lr", "3e-3", "--work", str(work),
             "--resume", "--aux-layers", "0", "--init-from", str(distilled_eagle["out"]), "--bf16-logits",
             "--feature-noise", "0.1")
    assert main(tiny_run_args(distilled_eagle["target_dir"], out, AUX_STEPS, *extra)) == 0
    return {"out": out, "work": work, "record": json.loads((out / "distill.json").read_text())}


def test_a_head_reading_aux_layers_trains_from_a_warm_start(distilled_aux, distilled_eagle):
    from specdec import eagle

    record = distilled_aux["record"]
    assert record["student"]["aux_layers"] == [0]
    assert record["config"]["bf16_logits"] is True  # this run's LM head trained under bf16 too
    assert record["config"]["feature_noise"] == 0.1  # and read noisy features
    shards = sorted(p.name for p in (distilled_aux["work"] / "data").iterdir())
    assert sorted(p.name for p in (distilled_aux["work"] / "aux-0").iterdir()) == shards
    # Started from the trained head: its first losses are near where that head ended, far
    # below where training from scratch started.
    scratch = [h["loss"] for h in distilled_eagle["record"]["history"] if "loss" in h]
    warm = [h["loss"] for h in record["history"] if "loss" in h]
    assert warm[0] < 0.8 * scratch[0], (warm, scratch)
    head = eagle.load(distilled_aux["out"])
    assert head.config.aux_layers == [0] and float(head.aux_fc.weight.detach().abs().max()) > 0


def test_a_head_reading_aux_layers_is_token_identical_on_the_target(distilled_aux, target, tokenizer):
    from specdec import eagle

    head = eagle.load(distilled_aux["out"], target=target)

    async def scenario():
        async with running_stack(target, tokenizer, target_head=head) as stack:
            async with Client(stack.address) as client:
                return [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4)) for p in SERVICE_PROMPTS]

    for text, result in zip(SERVICE_PROMPTS, run(scenario())):
        assert result.token_ids == reference_greedy(target, teacher.chat_ids(tokenizer, text), MAX_NEW), text


def test_single_step_fraction_trains_one_step_then_the_full_unroll(tmp_path, target, tokenizer, monkeypatch):
    """--single-step-fraction F: the first F of training (here by steps) unrolls one step
    only, the rest --unroll steps; what eagle_step_loss is given is what the log records."""
    given: list[int] = []
    step_loss = distill_losses.eagle_step_loss

    def recording(head, batch, unroll, *args, **kwargs):
        given.append(unroll)
        return step_loss(head, batch, unroll, *args, **kwargs)

    monkeypatch.setattr(distill_losses, "eagle_step_loss", recording)
    target_dir = save_model_dir(tmp_path / "target", target, tokenizer)
    out = tmp_path / "head"
    assert main(tiny_run_args(target_dir, out, 20, "--kind", "eagle", "--draft-vocab", "96", "--unroll", "3",
                              "--single-step-fraction", "0.5", "--log-every", "1")) == 0
    assert given == [1] * 10 + [3] * 10
    record = json.loads((out / "distill.json").read_text())
    assert [h["unroll"] for h in record["history"] if "loss" in h] == given


@pytest.mark.parametrize("extra", [("--kind", "eagle", "--single-step-fraction", "1"),
                                   ("--single-step-fraction", "0.5")], ids=["out_of_range", "with_kind_model"])
def test_a_bad_single_step_fraction_is_refused_before_any_data(tmp_path, target, tokenizer, capsys, extra):
    target_dir = save_model_dir(tmp_path / "target", target, tokenizer)
    assert main(tiny_run_args(target_dir, tmp_path / "refused", 4, *extra)) != 0
    assert "--single-step-fraction" in capsys.readouterr().err
    assert not (tmp_path / "refused.work" / "data").exists()
