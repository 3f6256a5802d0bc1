"""verl.trainer.ppo.metric_utils, as far as fsdptrain has a counterpart.

compute_data_metrics -> fsdptrain's typed metrics (Mean / Max / Min over sequences or tokens) and value_loss's
vf_explained_var;
calc_maj_val -> fsdptrain.rl.eval_metrics.majority_index; process_validation_metrics -> sampled_eval_metrics
(mean@n, maj@n at the full n; fsdptrain has no bootstrap). bootstrap_metric, compute_timing_metrics and
compute_throughout_metrics have no fsdptrain counterpart (verl's bootstrap estimates and trainer bookkeeping;
fsdptrain's pass@k is the unbiased estimator, docs/evaluation.md, and its timings are docs/performance.md's): they
raise NotImplementedError.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from fsdptrain.rl.aggregate import LossNormalizers, SeqLayout, count_tokens_and_seqs
from fsdptrain.rl.eval_metrics import majority_index, sampled_eval_metrics
from fsdptrain.metrics.typed import Max, Mean, Min, finalize
from fsdptrain.rl.value_loss import value_loss


def _compute_response_info(batch):
    raise NotImplementedError("fsdptrain has no counterpart of verl's _compute_response_info")


def _stats(name, values, valid):
    return {f"{name}/mean": Mean.of(values, valid), f"{name}/max": Max.of(values, valid),
            f"{name}/min": Min.of(values, valid)}


def compute_data_metrics(batch, use_critic=True):
    b = batch.batch
    mask = b["response_mask"].bool()
    layout = SeqLayout(mask.shape, None, mask.device)
    every_seq = torch.ones(mask.shape[0], dtype=torch.bool)
    metrics = {}
    metrics.update(_stats("critic/score", layout.seq_sum(b["token_level_scores"] * mask), every_seq))
    metrics.update(_stats("critic/rewards", layout.seq_sum(b["token_level_rewards"] * mask), every_seq))
    metrics.update(_stats("critic/advantages", b["advantages"], mask))
    metrics.update(_stats("critic/returns", b["returns"], mask))
    if use_critic:
        values, returns = b["values"], b["returns"]
        metrics.update(_stats("critic/values", values, mask))
        num_tokens, num_seqs = count_tokens_and_seqs(mask)
        _, critic = value_loss(values, values, returns, mask, norms=LossNormalizers(num_tokens, num_seqs),
                               agg_mode="token-mean", cliprange_value=None)
        metrics["critic/vf_explained_var"] = critic["vf_explained_var"]
    width = b["responses"].shape[-1]
    metrics.update(_stats("response_length", layout.seq_sum(mask.to(torch.float64)), every_seq))
    prompt_mask = b["attention_mask"][:, :-width].bool()
    metrics.update(_stats("prompt_length", layout.seq_sum(prompt_mask.to(torch.float64)), every_seq))
    out = finalize(metrics)
    if not use_critic:
        out.pop("critic/vf_explained_var", None)
    return out


def compute_timing_metrics(batch, timing_raw):
    raise NotImplementedError("fsdptrain has no counterpart of verl's per-token timing metrics (docs/performance.md)")


def compute_throughout_metrics(batch, timing_raw, n_gpus):
    raise NotImplementedError("fsdptrain has no counterpart of verl's throughput bookkeeping (docs/performance.md)")


def bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    raise NotImplementedError("fsdptrain has no bootstrap estimate; its pass@k is unbiased (docs/evaluation.md)")


def calc_maj_val(data, vote_key, val_key):
    return data[majority_index([str(d[vote_key]) for d in data])][val_key]


def process_validation_metrics(data_sources, sample_uids, infos_dict, seed=42):
    """Per data source and variable, fsdptrain's mean@n and (with `pred`) maj@n over the prompts' n samples."""
    groups: dict = defaultdict(lambda: defaultdict(list))
    for i, (source, uid) in enumerate(zip(data_sources, sample_uids)):
        groups[source][uid].append(i)
    out: dict = defaultdict(dict)
    preds = infos_dict.get("pred")
    for source, prompts in groups.items():
        for var, values in infos_dict.items():
            if var == "pred" or not isinstance(values[0], (int, float)):
                continue
            for n in sorted({len(rows) for rows in prompts.values()}):
                rows = [r for r in prompts.values() if len(r) == n]
                rewards = [[float(values[i]) for i in r] for r in rows]
                answers = [[str(preds[i]) for i in r] for r in rows] if preds is not None else None
                found = finalize(sampled_eval_metrics(rewards, answers, n=n, ks=[], threshold=0.0))
                out[source].setdefault(var, {})[f"mean@{n}"] = found[f"eval/mean@{n}"]
                if answers is not None:
                    out[source][var][f"maj@{n}/mean"] = found[f"eval/maj@{n}"]
    return dict(out)
