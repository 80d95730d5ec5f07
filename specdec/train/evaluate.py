"""How good and how cheap a trained draft is, measured as it will be served.

Held-out agreement: how often the draft's greedy token is the target's, on held-out
prompts' reference answers (the target's greedy ones). The acceptance it implies is
simulated exactly along those answers (simulate_rounds, simulate_chains) and turned into
the alpha of specdec.speedup; c is one draft step over one target step, each on its
serving path (specdec.runtime.costs).
"""

from __future__ import annotations

import torch

from specdec import eagle
from specdec.runtime.costs import measure_draft_model, measure_head, measure_target
from specdec.runtime.load import serving_lm
from specdec.speedup import alpha_from_acceptance_rate
from specdec.train.examples import EagleExample, Example, collate, collate_eagle

EVAL_K = 4  # draft tokens per round in the simulated acceptance
EVAL_BATCH = 16  # held-out sequences per evaluation forward
COST_CONTEXT_TOKENS = 200  # context at which the draft/target step cost ratio c is measured


def simulate_rounds(agree: list[bool], k: int) -> tuple[int, int, int]:
    """(rounds, proposed, accepted) of greedy speculative decoding along one reference
    answer, given agree[j]: the draft's argmax after reference[:j] equals reference[j].

    Exact under greedy decoding: a draft token is accepted only if all before it were, so
    every accepted token was predicted from the reference prefix itself (teacher forcing);
    each round commits its accepted tokens plus the target's correction or bonus token.
    """
    rounds = proposed = accepted = 0
    position, length = 0, len(agree)
    while position < length:
        block = min(k, length - position)
        run = 0
        while run < block and agree[position + run]:
            run += 1
        rounds += 1
        proposed += block
        accepted += run
        position += run + 1
    return rounds, proposed, accepted


def simulate_chains(chain_ok: list[list[bool]], prompt_len: int, length: int, k: int) -> tuple[int, int, int]:
    """(rounds, proposed, accepted) of greedy speculative decoding along a reference of
    `length` tokens (the first prompt_len the prompt), given chain_ok[s][c]: the draft's
    (s+1)-th token of a chain started after committed position c is the reference's."""
    rounds = proposed = accepted = 0
    last = prompt_len - 1  # the last committed position
    while last < length - 1:
        block = min(k, length - 1 - last)
        run = 0
        while run < block and chain_ok[run][last]:
            run += 1
        rounds, proposed, accepted = rounds + 1, proposed + block, accepted + run
        last += run + 1
    return rounds, proposed, accepted


def _metrics(agreed: int, total: int, rounds: int, proposed: int, accepted: int, k: int) -> dict:
    rate = accepted / proposed if proposed else 0.0
    return {"heldout_top1_agreement": agreed / total if total else 0.0, "sim_k": k,
            "sim_acceptance_rate": rate, "sim_alpha": alpha_from_acceptance_rate(rate, k),
            "sim_tokens_per_round": total / rounds if rounds else 0.0, "heldout_positions": total}


@torch.inference_mode()
def evaluate_model(student, examples: list[Example], pad_id: int, k: int = EVAL_K) -> dict:
    """Held-out top-1 agreement with the teacher, and the acceptance it implies at k (fp32,
    as the draft is served)."""
    was_training = student.training
    student.eval()
    agreed = total = rounds = proposed = accepted = 0
    for start in range(0, len(examples), EVAL_BATCH):
        chunk = examples[start:start + EVAL_BATCH]
        batch = collate(chunk, pad_id)
        hidden = student.model(input_ids=batch.input_ids).last_hidden_state  # [B, T, H]
        hidden = hidden.reshape(-1, hidden.shape[-1])[batch.rows]  # [N, H]
        predicted = student.lm_head(hidden).argmax(-1)  # [N]
        agree = (predicted == batch.topk_ids[:, 0]).tolist()
        agreed += sum(agree)
        total += len(agree)
        offset = 0
        for example in chunk:
            n = len(example.topk_ids)
            r, p, a = simulate_rounds(agree[offset:offset + n], k)
            rounds, proposed, accepted, offset = rounds + r, proposed + p, accepted + a, offset + n
    student.train(was_training)
    return _metrics(agreed, total, rounds, proposed, accepted, k)


@torch.inference_mode()
def evaluate_eagle(head: eagle.EagleHead, examples: list[EagleExample], pad_id: int, index_of: torch.Tensor,
                   k: int, batch_size: int = EVAL_BATCH) -> dict:
    """Greedy k-token chains drafted from every answer position, as the worker drafts
    them (true features for committed positions, its own after), against the reference
    greedy answer: exact acceptance (a draft counts only if all before it were right, and
    then the chain's tokens are the reference's)."""
    was_training = head.training
    head.eval()
    agreed = total = rounds = proposed = accepted = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = collate_eagle(chunk, pad_id, index_of, head.config.hidden_size)
        outputs = head.unrolled(batch.tokens, batch.features_in, k)
        # predicted[s][b, t]: step s+1's token at position t (a target id)
        predicted = [head.draft_vocab[head.logits(o.float()).argmax(-1)] for o in outputs]
        for b, e in enumerate(chunk):
            n = len(e.tokens)
            # chain_ok[s][c]: step s+1 drafted from committed position c (at c + s) is right
            chain_ok = [[c + s + 1 < n and int(predicted[s][b, c + s]) == int(e.tokens[c + s + 1])
                         for c in range(n)] for s in range(k)]
            r, p, a = simulate_chains(chain_ok, e.prompt_len, n, k)
            rounds, proposed, accepted = rounds + r, proposed + p, accepted + a
            agreed += sum(chain_ok[0][e.prompt_len - 1:n - 1])
            total += n - e.prompt_len
    head.train(was_training)
    return _metrics(agreed, total, rounds, proposed, accepted, k)


def model_cost_ratio(target, draft, context: list[int]) -> dict:
    """c: one draft step over one target step, both on the serving path (specdec.runtime.cpu),
    1 new token on a cache holding `context`."""
    target_s = measure_target(serving_lm(target), context, 1).target_step_s
    draft_s = measure_draft_model(serving_lm(draft), context)
    return {"context_tokens": len(context), "target_step_s": target_s, "draft_step_s": draft_s,
            "c": draft_s / target_s}


def eagle_cost_ratio(target, head: eagle.EagleHead, context: list[int]) -> dict:
    """c: one head step (1 position on a cache holding `context`, then its argmax) over one
    target step, each on its serving path."""
    target_s = measure_target(serving_lm(target), context, 1).target_step_s
    draft_s = measure_head(eagle.fast_cpu_head(head), context)  # as the workers serve it
    return {"context_tokens": len(context), "target_step_s": target_s, "draft_step_s": draft_s,
            "c": draft_s / target_s}
