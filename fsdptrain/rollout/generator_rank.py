"""A generator rank of ``rollout.placement=separate`` (docs/async.md): the policy unsharded in the param dtype, the
run's sampler and engine, and a loop that samples the trainer ranks' jobs step after step, nonstop.

For each step ``t`` from the run's first generated one (fsdptrain/generation/schedule.py), the generator first takes
the versions of the weights until it holds ``max(0, t - k)`` (between decode steps, never in the middle of one), then
for each trainer rank it serves (in rank order) receives that rank's groups of step ``t``, samples them exactly as
that rank would colocated (its rank's seeds), and sends the samples back without waiting for them to arrive. It ends
when the run's last step is sampled, or when a trainer tells it the run stops early.

Signals: SIGTERM and Ctrl-C reach every rank; the trainer ranks decide (they finish their step, save, and tell the
generators to stop), so here they only mark that a stop was asked for: a generator whose trainers are then gone
leaves with 0. Anything else that ends it (an error in the sampler, the policy not fitting) is reported in one line
naming the rank (fsdptrain/distributed/rank_errors.py), and the trainers end the run naming it too.
"""

from __future__ import annotations

import signal
import time

import torch
from omegaconf import DictConfig

from fsdptrain.config import ConfigError, multi_turn
from fsdptrain.distributed.placement import Bridge
from fsdptrain.distributed.rank_errors import PEER_LOST_EXIT, report_failure
from fsdptrain.distributed.weight_handover import WeightReceiver
from fsdptrain.generation.engines import make_decoder
from fsdptrain.generation.gather import free_memory_bytes
from fsdptrain.generation.schedule import first_generated_step, generating_version
from fsdptrain.model.loading import DTYPES, build_full_model, build_tokenizer, meta_model, model_source, resolve_config
from fsdptrain.model.lora import lora_settings
from fsdptrain.rewards.runner import UserCodeError
from fsdptrain.rollout.generator_link import Reply
from fsdptrain.rollout.multi_turn import MultiTurnSampler
from fsdptrain.rollout.single_turn import SingleTurnSampler

MEMORY_SHARE = 0.8
"""The share of a generator's free memory its unsharded policy may take (the rest: activations, the KV cache)."""


def generator_policy(cfg: DictConfig, tokenizer, device: torch.device) -> torch.nn.Module:
    """The policy a generator samples with: built as the trainers build theirs (adapters included), unsharded, in
    ``parallel.param_dtype``, on ``device``; a ConfigError when it does not fit the device."""
    source = model_source(cfg, tokenizer)
    dtype = DTYPES[cfg.parallel.param_dtype]
    lora = lora_settings(cfg)
    shape = meta_model("policy", resolve_config(path=source["path"], config=source["config"]), lora=lora)
    needed = sum(p.numel() for p in shape.parameters()) * torch.empty((), dtype=dtype).element_size()
    free = free_memory_bytes(device)
    if needed > MEMORY_SHARE * free:
        raise ConfigError(f"rollout.placement=separate: the unsharded policy needs {needed / 2**30:.2f} GiB in "
                          f"{cfg.parallel.param_dtype}, more than {MEMORY_SHARE:g} of a generator rank's free memory "
                          f"({free / 2**30:.2f} GiB): use rollout.placement=colocated, which generates sharded")
    model = build_full_model("policy", **source, seed=cfg.trainer.seed, lora=lora)
    return model.to(device=device, dtype=dtype)


class _StopFlag:
    """SIGTERM / Ctrl-C only mark a stop here (see the module docstring)."""

    def __init__(self):
        self.requested = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, _signum, _frame) -> None:
        self.requested = True


def serve(cfg: DictConfig, bridge: Bridge) -> int:
    """This generator rank's whole run; returns its exit code."""
    stop = _StopFlag()
    placement = bridge.placement
    me = placement.global_rank
    try:
        return _serve(cfg, bridge, stop)
    except ConfigError as err:
        report_failure(f"error: generator rank {me}: {err}", rank=me)
        return 2
    except UserCodeError as err:
        report_failure((err.user_traceback.rstrip("\n") + "\n" if err.user_traceback else "")
                       + f"error: generator rank {me}: {err}", rank=me)
        return 2
    except _TrainersGone:
        return 0 if stop.requested else PEER_LOST_EXIT
    except Exception as err:  # noqa: BLE001 - one line naming the rank, for the launcher to print
        report_failure(f"error: generator rank {me} failed: {type(err).__name__}: {err}", rank=me)
        return 1


class _TrainersGone(Exception):
    pass


def _serve(cfg: DictConfig, bridge: Bridge, stop: _StopFlag) -> int:
    placement = bridge.placement
    device = bridge.device
    tokenizer = build_tokenizer(cfg)
    model = generator_policy(cfg, tokenizer, device)
    sampler = MultiTurnSampler(cfg, tokenizer) if multi_turn(cfg) else SingleTurnSampler(cfg, tokenizer)
    decoder = make_decoder(cfg, model, tokenizer, device)
    receiver = WeightReceiver(model, bridge, bucket_bytes=cfg.rollout.weight_bucket_mb * 2**20)
    k, repeat = cfg.rollout.max_staleness, cfg.rollout.n
    served = placement.served_by(placement.generator_index)
    try:
        start = _recv(bridge, 0)
        if "stop" in start:  # the trainers ended before the first step (a refused resume, an error, a stop)
            return 0
        for step in range(first_generated_step(start["start"], k), start["num_steps"]):
            began = time.perf_counter()
            while receiver.version is None or receiver.version < generating_version(step, k):
                _take(receiver)
            for rank in served:
                job = _recv(bridge, rank)
                if "stop" in job:
                    return 0
                assert job["step"] == step, (job["step"], step)
                waited = time.perf_counter() - began
                decoding = time.perf_counter()
                samples = sampler.sample(decoder, job["groups"], repeat=repeat, mode="train", step=step,
                                         round_index=0, rank=rank)
                decode_s = time.perf_counter() - decoding
                masks = samples.response_masks or [None] * len(samples)
                tokens = sum(len(ids) if mask is None else sum(mask) for ids, mask in zip(samples.response_ids, masks))
                reply = Reply(step=step, version=receiver.version, samples=samples, tokens=tokens,
                              decode_s=decode_s, wait_s=waited)
                try:
                    bridge.send(reply, rank)
                except RuntimeError as err:
                    raise _TrainersGone() from err
                began = time.perf_counter()
        try:
            bridge.flush()
        except RuntimeError as err:
            raise _TrainersGone() from err
        return 0
    finally:
        sampler.close()


def _recv(bridge: Bridge, src: int):
    try:
        return bridge.recv(src)
    except RuntimeError as err:
        raise _lost(err, bridge) from err


def _take(receiver: WeightReceiver) -> None:
    try:
        receiver.receive()
    except RuntimeError as err:
        raise _lost(err, receiver.bridge) from err


def _lost(err: RuntimeError, bridge: Bridge) -> Exception:
    """What a failed receive means here: the trainers hang (a timeout: an error of its own), or they are gone."""
    if "timed out" in str(err).lower():
        return RuntimeError(f"its trainers sent nothing for {bridge.timeout_s:g} s (rollout.generator_timeout_s)")
    return _TrainersGone()
