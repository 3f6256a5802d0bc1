"""The typed configuration schema, registered with hydra's ConfigStore.

Every group of ``conf/`` has a dataclass here; each field carries a one-line attribute docstring (the string literal
right below it), which ``docs/configuration.md`` mirrors and a test keeps in step. Each field declares its choices
or range where it is defined (``choice(...)``, ``bounded(...)``: :mod:`fsdptrain.config.fields`), and
:mod:`fsdptrain.config.validate` checks them right after composition. Choices are plain strings (an Enum would reject
the hyphenated names users type, such as ``token-sum``). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from fsdptrain.config.fields import bounded, choice, each_bounded, each_of, unbounded
from fsdptrain.registry import names
from fsdptrain.registry.constants import KL_CLAMP
from fsdptrain.registry.names import DRAFT_ON

ATTN_BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa_segments")
ALGORITHM_NAMES = ("ppo", "grpo")
DTYPES = ("float32", "bfloat16", "float16")
CHECK_DTYPES = ("float64", "model")
LR_SCHEDULES = ("constant", "cosine")
DATA_SOURCES = ("task", "jsonl", "prompts", "sft")
LONG_PROMPTS = ("skip", "error")
LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")
TASKS = ("repeat_digit", "copy_digits", "reverse_digits", "sort_digits")
DEVICES = ("auto", "cpu", "cuda")
RESUME_MODES = ("never", "auto")
VALUE_INITS = ("policy", "seed", "reward_model")
REWARD_MODEL_NORMALIZE = ("none", "batch", "running")
MODEL_ARCHS = ("llama", "qwen2", "mistral")
GATHER_MODES = ("auto", "always", "never")
ROLLOUT_ENGINES = ("generate", "continuous")
PLACEMENTS = ("colocated", "separate")
SHARE_PROMPTS_MODES = ("auto", "true", "false")
RECOMPUTE_MODES = ("auto", "always")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
DEFAULT_STEPS = 100
"""Training steps when neither trainer.steps nor trainer.epochs is set."""
LORA_ALL_LINEAR = "all-linear"
"""``model.lora.target_modules``: every linear module inside the decoder layers (never the output head or value head)."""


@dataclass
class LoraConfig:
    r: int = bounded(0, ge=0)
    """LoRA rank of the policy's adapters; 0 trains every weight (full fine-tuning) (docs/lora.md)."""
    alpha: float = bounded(16.0, gt=0)
    """LoRA scaling numerator: the adapter's update is (alpha / r) * B A x."""
    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapters' input (0 keeps forwards deterministic, which check-metrics needs)."""
    target_modules: Any = LORA_ALL_LINEAR
    """The linear modules that get adapters: all-linear (every linear module of the decoder layers) or a list of module names such as [q_proj, v_proj]."""
    critic: bool = False
    """Train the PPO value model through its own adapters too (its value head always trains); false: every critic weight trains."""


@dataclass
class MoeConfig:
    aux_loss_coef: Optional[float] = bounded(None, ge=0)
    """Weight of the load-balancing loss added to the policy loss, defined once over the global batch (docs/moe.md); null: the model config's router_aux_loss_coef; 0: none."""
    routing_replay: bool = False
    """Replay the experts chosen at generation in the training and experience forwards (docs/moe.md, "Routing replay")."""


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local Hugging Face model folder (weights + config + tokenizer), or a `.gguf` file (read through transformers
    with the `gguf` extra, docs/your-task.md); null builds the tiny model below from its config."""
    gguf_file: Optional[str] = None
    """A `.gguf` file inside the folder `path` to load the policy, value model and tokenizer from, instead of the
    folder's own weights; null: the folder's weights (or `path` itself when it is a `.gguf` file)."""
    arch: str = choice("llama", MODEL_ARCHS)
    """Architecture of the config-built model when `path` is null."""
    hidden_size: int = bounded(64, ge=1)
    """Hidden width of the config-built model."""
    num_layers: int = bounded(2, ge=1)
    """Decoder layers of the config-built model."""
    num_heads: int = bounded(4, ge=1)
    """Attention heads of the config-built model."""
    num_kv_heads: int = bounded(2, ge=1)
    """Key/value heads of the config-built model (grouped-query attention when below num_heads)."""
    intermediate_size: int = bounded(128, ge=1)
    """MLP width of the config-built model."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output projection (config-built model)."""
    attn_backend: str = choice("auto", ATTN_BACKENDS)
    """Packed attention for training forwards: auto, flash_attn, torch_varlen or sdpa_segments (generation uses sdpa)."""
    value_init: str = choice("policy", VALUE_INITS)
    """Where the value model's backbone starts: policy (copy of the policy's weights), seed (fresh init) or reward_model (the first of reward.models)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (docs/lora.md)."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts models: the load-balancing loss and routing replay (docs/moe.md)."""


DISTILL_TASK_REWARDS = ("ignore", "add")
"""``algorithm.distill.task_reward``: whether the task reward's advantage is added to the distillation advantage."""


@dataclass
class DistillConfig:
    teacher: Optional[str] = None
    """On-policy distillation (docs/algorithms.md, "On-policy distillation"): the teacher, a local Hugging Face folder or a `.gguf` file, frozen and sharded like the reference; its tokenizer must be the student's. null: no distillation."""
    coef: float = bounded(1.0, gt=0)
    """Weight of the per-token reverse KL (log p_student - log p_teacher of each sampled policy token) in the advantage: A_t = [task_reward=add] A_task_t - coef * kl_t."""
    task_reward: str = choice("ignore", DISTILL_TASK_REWARDS)
    """ignore: the advantage is the distillation term alone (the reward is still scored and logged); add: the estimator's advantage of the task reward (e.g. GRPO's group advantage) plus the distillation term."""


@dataclass
class AlgorithmConfig:
    name: str = choice("ppo", ALGORITHM_NAMES)
    """Preset name, for the record: ppo or grpo."""
    adv_estimator: str = choice("gae", names.ADV_ESTIMATORS, user_function=True)
    """Advantage estimator: gae (needs the value model), grpo, rloo, reinforce_plus_plus(_baseline), or a user's
    module:function / path.py:function (docs/algorithms.md)."""
    use_critic: bool = True
    """Train a value model (PPO). GAE requires it."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """Discount for GAE."""
    lam: float = bounded(1.0, ge=0, le=1)
    """GAE lambda."""
    whiten_advantages: bool = True
    """Whiten GAE advantages with mean and variance taken over the whole global batch."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's standard deviation (false gives Dr. GRPO's mean-only baseline)."""
    ppo_epochs: int = bounded(1, ge=1)
    """Passes over each step's experience."""
    clip_ratio_low: float = bounded(0.2, gt=0, le=1)
    """PPO clip: ratio lower bound is 1 - clip_ratio_low."""
    clip_ratio_high: float = bounded(0.2, gt=0)
    """PPO clip: ratio upper bound is 1 + clip_ratio_high."""
    clip_ratio_c: Optional[float] = bounded(3.0, gt=1)
    """Dual-clip bound for negative advantages (> 1); null turns dual-clip off."""
    seq_level_ratio: bool = False
    """Use the sequence-level importance ratio (GSPO) instead of the per-token one."""
    cliprange_value: float = bounded(0.2, gt=0)
    """Value clipping range around the old values."""
    entropy_coef: float = bounded(0.0, ge=0)
    """Weight of the entropy bonus in the policy loss."""
    use_kl_loss: bool = False
    """Add a KL penalty to a frozen reference policy to the loss (builds the reference model)."""
    kl_loss_coef: float = bounded(0.001, ge=0)
    """Weight of the KL loss term."""
    kl_estimator: str = choice("k3", names.KL_ESTIMATORS)
    """KL estimator: k1, k2, k3 (low variance), abs, mse, k1+, k3+ or abs+ (straight-through; docs/algorithms.md)."""
    kl_clamp: Optional[float] = bounded(KL_CLAMP, gt=0)
    """Bound on the value of the k3 and k3+ estimators (verl's 10); null for no clamp."""
    policy_loss: str = choice("vanilla", names.POLICY_LOSSES, user_function=True)
    """Policy-gradient term: vanilla (PPO clip), cispo, gmpo, dro, or a user's module:function / path.py:function."""
    plugins: list[str] = field(default_factory=list)
    """Modules (dotted names or path.py files) imported at start, in the CLI and on every rank, whose
    @fsdptrain.register_adv_estimator / register_policy_loss names adv_estimator and policy_loss may then take."""
    dro_beta: Optional[float] = bounded(None, gt=0)
    """DRO's quadratic penalty weight (> 0); required with policy_loss=dro, which has no default (as verl)."""
    rollout_correction: str = choice("none", ("none", *names.ROLLOUT_CORRECTION_MODES))
    """Off-policy correction from behaviour log-probs: none, tis (truncated) or mis (masked importance weights)."""
    rollout_correction_level: str = choice("token", names.ROLLOUT_CORRECTION_LEVELS)
    """Importance weights per token, or per sequence: the product (sequence) or the geometric mean (geometric) of its token ratios."""
    rollout_correction_cap: float = bounded(2.0, gt=0)
    """Upper bound C of the importance weights (tis truncates to C, mis zeroes a weight above C)."""
    rollout_correction_low: Optional[float] = bounded(None, gt=0)
    """Lower bound L of the importance weights, mis only: a weight below L is zeroed too (IcePop); null: none."""
    rollout_rejection: str = choice("none", ("none", *names.ROLLOUT_REJECTION_LEVELS))
    """Rejection sampling: drop tokens, or sequences, whose old/behaviour ratio is out of [low, high]."""
    rollout_rejection_low: float = bounded(0.5, gt=0)
    """Lower bound of the ratios rollout_rejection keeps (> 0, below rollout_rejection_high)."""
    rollout_rejection_high: float = bounded(2.0, gt=0)
    """Upper bound of the ratios rollout_rejection keeps."""
    rollout_rejection_divergence: str = choice("none", ("none", *names.ROLLOUT_DIVERGENCE_REJECTIONS))
    """Rejection by divergence (verl's rollout_rs k2/k3 options): drop tokens, or sequences, whose k2 or k3 estimate (per token, or its seq_sum/seq_mean/seq_max) exceeds rollout_rejection_divergence_max; with rollout_rejection, a token must pass both."""
    rollout_rejection_divergence_max: Optional[float] = bounded(None, gt=0)
    """Upper bound of the divergence rollout_rejection_divergence keeps (> 0); required with it, no default (as verl)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop prompt groups whose samples all got the same reward."""
    filter_groups_max_rounds: int = bounded(3, ge=1)
    """Dynamic sampling: generation rounds per step at most, until rollout.prompts_per_step groups are useful."""
    kl_in_reward_coef: float = bounded(0.0, ge=0)
    """Per-token KL penalty subtracted from the reward (0 turns it off; needs the reference model)."""
    recompute_old_logprobs: str = choice("auto", RECOMPUTE_MODES)
    """Old log-probs: auto skips their pass when the update is strictly on-policy (exact), always recomputes."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (docs/algorithms.md)."""


@dataclass
class LossConfig:
    agg_mode: str = choice("token-mean", names.AGG_MODES)
    """Loss aggregation: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-sum-norm, seq-mean-token-mean."""
    loss_scale_factor: Optional[float] = bounded(None, gt=0)
    """Constant divisor of seq-mean-token-sum-norm; null uses the configured maximum response length."""
    logprob_chunk_size: int = bounded(256, ge=1)
    """Tokens per chunk of the fused output projection (bounds the logits held at once)."""


@dataclass
class DataConfig:
    source: str = choice("task", DATA_SOURCES)
    """Where experience comes from: task (a bundled digit task), prompts (your prompt files), jsonl (offline rollouts) or sft (demonstrations: fsdptrain sft sets it)."""
    task: str = choice("repeat_digit", TASKS)
    """Bundled task when source=task: repeat_digit, copy_digits, reverse_digits or sort_digits."""
    num_rows: int = bounded(4096, ge=1)
    """source=task: training rows generated from data.seed (visited epoch by epoch like a prompt file's rows)."""
    path: Any = None
    """source=prompts: a local .jsonl/.json/.parquet/.csv file, a list of them, or a save_to_disk folder; source=jsonl: the rollouts file; source=sft: the demonstrations (same formats as prompts)."""
    prompt_key: str = "prompt"
    """source=prompts: the column holding the prompt (a string, or a chat: a list of {role, content} messages)."""
    eval_path: Any = None
    """source=prompts: held-out prompts for the greedy evaluation (same formats as path); null holds out data.num_eval_prompts rows of path; source=sft: held-out demonstrations for eval/loss (null: none)."""
    max_prompt_length: Optional[int] = bounded(None, ge=1)
    """source=prompts: prompts with more tokens are skipped and counted (or an error, see long_prompts); null keeps all."""
    long_prompts: str = choice("skip", LONG_PROMPTS)
    """source=prompts: what a prompt over max_prompt_length (or that with rollout.max_new_tokens passes the model's max_position_embeddings) does: skip (counted) or error."""
    skip_bad_rows: bool = False
    """Offline data: skip and count malformed rows instead of stopping with an error."""
    num_eval_prompts: int = bounded(32, ge=0)
    """Prompts of the greedy evaluation: source=task generates them; source=prompts without eval_path holds out this many rows of path (never trained on; 0 for none)."""
    seed: int = bounded(1234, ge=0)
    """Seed of the prompt order (and of the bundled task's rows and the held-out split)."""


@dataclass
class RewardConfig:
    functions: Optional[list[str]] = None
    """Reward functions: built-in names (exact_match, math, think_format, word_match), module:function or path.py:function; null means word_match (the bundled tasks' reward)."""
    weights: Optional[list[float]] = None
    """One weight per function; null weighs each 1.0. A sample's reward is the weighted sum over the functions that applied."""
    num_workers: int = bounded(0, ge=0)
    """Worker processes per rank that run the functions (0: in the training process, once per step)."""
    timeout_s: Optional[float] = bounded(None, gt=0)
    """Longest one call (a reward function, a tool, an environment method) may run, not counting a worker's start-up imports; a timed-out reward call scores timeout_score. In a worker the call is killed with the worker and every process it started; in the training process (num_workers=0) it is abandoned on its thread. null: no limit."""
    timeout_score: float = unbounded(0.0)
    """Score of each sample whose call timed out (counted in reward/<function>/num_timed_out)."""
    models: list[str] = field(default_factory=list)
    """Local folders of learned reward models (sequence classifiers, one label); their weighted scores add to the functions' total (docs/reward-models.md)."""
    model_weights: Optional[list[float]] = None
    """One weight per reward model; null weighs each 1.0."""
    model_normalize: str = choice("none", REWARD_MODEL_NORMALIZE)
    """Scaling of each reward model's scores: none, batch (whitened over the step's global batch) or running (running moments, kept in checkpoints)."""
    model_clip: Optional[float] = bounded(None, gt=0)
    """Clamp each normalised reward-model score to [-model_clip, model_clip]; null: no clipping."""
    model_offload: bool = False
    """Keep the reward models' shards on the CPU between scoring phases (a GPU run's memory saver)."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = bounded(16, ge=1)
    """Prompts per training step, across all ranks."""
    n: int = bounded(4, ge=1)
    """Samples per prompt (a group; never split across ranks)."""
    max_new_tokens: int = bounded(6, ge=1)
    """Largest response length: generated, or declared for offline rollouts (data=jsonl: a longer response is a bad row); with tools, the budget of the whole trajectory (model and tool tokens)."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature (log-probs in training use the same temperature)."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    gather_weights: str = choice("auto", GATHER_MODES)
    """Generate with the policy all-gathered once per step: auto (when it fits in free memory), always or never. On several ranks the continuous engine and multi-turn generation need it gathered (never, or auto finding no room, is refused); single-turn generate can run sharded."""
    gather_weights_max_share: float = bounded(0.5, gt=0, le=1)
    """gather_weights=auto gathers when the unsharded policy needs at most this share of free memory."""
    tools: Optional[list[str]] = None
    """Tools the policy may call (multi-turn rollouts, docs/multi-turn.md): functions with type hints and a Google-style docstring, as module:function or path.py:function."""
    environment: Optional[str] = None
    """An environment class (path.py:Class or module:Class), one instance per sample: reset(**row_columns), its public methods are tools, optional get_reward() (docs/multi-turn.md)."""
    agent: Optional[str] = None
    """The user's agent (path.py:run or module:run): async def run(client, row) -> reward | dict | None, given an openai.AsyncOpenAI client bound to its trajectory's session on a loopback OpenAI-compatible endpoint (docs/agents.md); needs the agents extra."""
    max_turns: int = bounded(4, ge=1)
    """With tools or an agent: most assistant turns per sample (a tool call in the last one is not run; an agent's request past it is answered empty; truncated/max_turns)."""
    max_tool_response_tokens: int = bounded(256, ge=1)
    """With tools: most tokens of one tool result's content; a longer one is cut (tools/num_cut_results)."""
    engine: str = choice("continuous", ROLLOUT_ENGINES)
    """How rollouts are decoded (docs/rollout.md): generate (transformers' generate, one padded batch per call; multi-turn one group and turn at a time) or continuous (every trajectory of the rank in one decode loop, finished rows leave at once, cache kept across turns, tools run while rows decode; row-seeded, so ranks never change a token)."""
    max_live_rows: int = bounded(64, ge=1)
    """rollout.engine=continuous: most rows decoded at once; waiting rows enter as rows finish."""
    max_live_tokens: int = bounded(262144, ge=1)
    """rollout.engine=continuous: most cache positions (live rows x the longest live row) before waiting rows are held back; one row always runs."""
    placement: str = choice("colocated", PLACEMENTS)
    """Where rollouts are generated (docs/async.md): colocated (the trainer ranks take turns generating and training) or separate (the last rollout.generator_ranks ranks only generate, nonstop, while the others train)."""
    generator_ranks: int = bounded(1, ge=1)
    """placement=separate: how many of the launched ranks generate (the last ones); the others train."""
    max_staleness: int = bounded(0, ge=0)
    """placement=separate: k; step t's rollouts are generated by the weights after step max(0, t - k) exactly. 0 is the synchronous trainer, bit for bit."""
    weight_bucket_mb: int = bounded(64, ge=1)
    """placement=separate: the weights go to the generators in broadcasts of at most this many MiB (a larger tensor goes alone)."""
    generator_timeout_s: float = bounded(1800.0, gt=0)
    """placement=separate: a trainer waits at most this long for a generator's rollouts, and a generator for its next job, before the run ends naming the rank."""


@dataclass
class TrainerConfig:
    steps: Optional[int] = bounded(None, ge=1)
    """Number of training steps; null means 100, or the steps trainer.epochs gives when that is set."""
    epochs: Optional[float] = bounded(None, gt=0)
    """Instead of steps (data=task or prompts): passes over the training rows, steps = ceil(epochs x rows / rollout.prompts_per_step)."""
    seed: int = bounded(0, ge=0)
    """Seed for model init and sampling."""
    mini_batches_per_step: int = bounded(1, ge=1)
    """Optimizer steps per epoch: the step's prompt groups are split into this many mini-batches."""
    token_budget: int = bounded(2048, ge=1)
    """Most tokens in one packed micro-batch on one rank."""
    share_prompts: str = choice("auto", SHARE_PROMPTS_MODES)
    """Packed forwards hold each prompt once, then every response to it (docs/packing.md, "Shared prompts"): fewer FLOPs and activations with rollout.n > 1; the same numbers up to rounding. auto: on wherever the backend, the model and the features in use allow (the start report says which and why), true or false."""
    lr: float = bounded(3.0e-3, gt=0)
    """Policy learning rate (3e-3: the embedded default climbs steadily on 1 and 2 ranks; 5e-3 collapsed late on 2)."""
    critic_lr: float = bounded(5.0e-3, gt=0)
    """Value model learning rate."""
    lr_schedule: str = choice("constant", LR_SCHEDULES)
    """Learning-rate schedule after warmup: constant or cosine."""
    warmup_steps: int = bounded(0, ge=0)
    """Linear warmup steps."""
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)
    """Cosine floor as a fraction of the peak learning rate."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    """AdamW's first-moment decay (policy, critic and drafter optimizers)."""
    adam_beta2: float = bounded(0.999, ge=0, lt=1)
    """AdamW's second-moment decay."""
    adam_eps: float = bounded(1e-8, gt=0)
    """AdamW's epsilon."""
    grad_clip: float = bounded(1.0, ge=0)
    """Policy gradient-norm clip (0 turns clipping off; the norm is still logged)."""
    critic_grad_clip: float = bounded(1.0, ge=0)
    """Value model gradient-norm clip (0 turns clipping off)."""
    max_nonfinite_in_a_row: int = bounded(3, ge=1)
    """Stop the run after this many consecutive steps skipped for a non-finite gradient norm."""
    grad_norm_warn_factor: float = bounded(10.0, gt=0)
    """Warn when the pre-clip grad norm stays above this factor times the clip threshold for 5 steps."""
    eval_every: int = bounded(25, ge=0)
    """Evaluation every this many steps (0 turns it off): the greedy eval/reward, and the sampled metrics with eval_n > 1 (docs/evaluation.md)."""
    eval_n: int = bounded(1, ge=1)
    """Samples per evaluation prompt at eval_temperature, for eval/pass@k, eval/mean@n and eval/maj@n; 1: the greedy evaluation alone."""
    eval_k: list[int] = each_bounded(lambda: [1], ge=1)
    """The k of each logged eval/pass@k (unbiased estimator from eval_n samples); each in [1, eval_n]."""
    eval_temperature: float = bounded(1.0, gt=0)
    """Sampling temperature of the eval_n evaluation samples (top_p 1)."""
    eval_correct_threshold: float = unbounded(1.0)
    """An evaluation sample is correct (pass@k, maj@n) when its reward (the weighted total) is >= this."""
    run_name: Optional[str] = None
    """Run name, a plain folder name under runs/ (no '/' or '..'); null: start time + random suffix. Keeps resumes stable."""
    run_dir: Optional[str] = None
    """Run directory; null means runs/<run_name>. Must be new, empty or fsdptrain's run folder (docs/checkpointing.md)."""
    resume: str = choice("never", RESUME_MODES)
    """Resume: never, or auto (newest intact checkpoint of the run); a used run directory needs auto or overwrite."""
    overwrite: bool = False
    """Start over in a run directory that holds a run: delete its checkpoints, metrics and export first."""
    allow_config_change: bool = False
    """Resume even though the model, algorithm or loss mode changed (the change is recorded in the run directory)."""
    device: str = choice("auto", DEVICES)
    """Device: auto (cuda when available), cpu or cuda."""


@dataclass
class ParallelConfig:
    dp_replicate: int = bounded(1, ge=1)
    """HSDP replica groups (1 = plain FSDP)."""
    dp_shard: str = "auto"
    """Ranks each replica shards over; auto = world size / (dp_replicate x cp)."""
    cp: int = bounded(1, ge=1)
    """Context parallelism: ranks that split each packed row of the update (world = dp_replicate x dp_shard x cp; docs/scaling.md)."""
    ep: int = bounded(1, ge=1)
    """Expert parallelism of a mixture-of-experts policy: ranks its experts are split over, tokens dispatched all-to-all (docs/moe.md)."""
    param_dtype: str = choice("float32", DTYPES)
    """Dtype of unsharded parameters in forward/backward (MixedPrecisionPolicy)."""
    reduce_dtype: str = choice("float32", DTYPES)
    """Dtype of the gradient reduce-scatter (MixedPrecisionPolicy)."""
    reshard_after_forward: bool = True
    """Free unsharded parameters after each layer's forward (trades memory for an all-gather in backward)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU (GPU runs only)."""
    compile: bool = False
    """torch.compile each decoder layer before sharding, for the training forwards (docs/performance.md: when it pays)."""
    compile_backend: str = choice("inductor", COMPILE_BACKENDS)
    """torch.compile backend with parallel.compile: inductor (generated kernels), aot_eager or eager (no codegen)."""


@dataclass
class LoggingConfig:
    progress: bool = True
    """Show a progress bar on rank 0."""
    backends: list[str] = each_of(LOGGING_BACKENDS, lambda: ["jsonl"])
    """Where metrics go: jsonl (metrics.jsonl, always written), tensorboard, wandb, mlflow (each needs its library)."""
    samples_every: int = bounded(10, ge=0)
    """Write a few prompts, completions and their rewards to samples.jsonl every this many steps (0 turns it off)."""


@dataclass
class PerfConfig:
    peak_tflops: Optional[float] = bounded(None, gt=0)
    """Peak dense TFLOP/s of one device in the param dtype for MFU; null: known GPUs auto, none on the CPU."""


@dataclass
class CheckpointConfig:
    every: int = bounded(0, ge=0)
    """Save a checkpoint every this many steps (0 turns periodic checkpoints off)."""
    keep: int = bounded(2, ge=1)
    """Keep this many newest checkpoints."""


@dataclass
class CheckConfig:
    dtype: str = choice("float64", CHECK_DTYPES)
    """check-metrics: float64 (every checked model, loss and optimizer in float64: rounding near 1e-13, one tight tolerance on any model) or model (in parallel.param_dtype)."""
    rtol: Optional[float] = bounded(None, ge=0)
    """check-metrics: relative tolerance of every comparison; null: 1e-9 with check.dtype=float64, 1e-5 with model."""
    atol: Optional[float] = bounded(None, ge=0)
    """check-metrics: absolute tolerance of every comparison; null: 1e-10 with check.dtype=float64, 1e-6 with model."""
    simulated_dp: int = bounded(2, ge=1)
    """check-metrics: data-parallel size simulated in one process."""
    num_prompts: int = bounded(4, ge=1)
    """check-metrics: prompt groups in the checked mini-batch (at most rollout.prompts_per_step; >= the ranks)."""


@dataclass
class DrafterConfig:
    enabled: bool = False
    """Co-train an EAGLE-3 drafter with the policy, in the same train step (docs/drafter.md)."""
    feature_layers: Optional[list[int]] = None
    """The three policy layers whose inputs feed the drafter (HF hidden_states indices); null: vLLM's default."""
    draft_vocab_size: Optional[int] = bounded(None, ge=1)
    """Tokens of the draft vocabulary (at most the policy's vocabulary); null: min(32000, the policy's vocabulary)."""
    vocab_path: Optional[str] = None
    """JSON file of the draft vocabulary's token ids (save_draft_vocab's format); null: built from the rollouts."""
    vocab_from_steps: int = bounded(1, ge=1)
    """Without vocab_path: count the tokens of the first this many steps' rollouts; the drafter trains from then on."""
    on: str = choice("response", DRAFT_ON)
    """Which predicted tokens train the drafter: response (response tokens only) or all."""
    loss_weight: float = bounded(1.0, ge=0)
    """Weight of the draft loss in loss = policy_loss + loss_weight * draft_loss."""
    lr: Optional[float] = bounded(None, gt=0)
    """The drafter's AdamW learning rate (its own optimizer, the policy's schedule); null: max(1e-4, trainer.lr)."""
    weight_decay: float = bounded(0.0, ge=0)
    """The drafter's AdamW weight decay."""
    refresh_passes: int = bounded(0, ge=0)
    """Drafter-only passes per mini-batch after the policy's step, taught by the updated policy (docs/drafter.md)."""
    grad_clip: float = bounded(1.0, ge=0)
    """Clip the drafter's gradient to this global L2 norm (its own clip; 0 turns clipping off)."""
    init_head_from_policy: bool = True
    """Start the draft head from the policy's output rows of the draft vocabulary."""
    num_layers: int = bounded(1, ge=1)
    """Decoder layers of the drafter: the EAGLE-3 midlayer, then Llama layers (vLLM serves any; SGLang only 1)."""
    path: Optional[str] = None
    """Start from a saved drafter (an export/drafter/ folder, its vocabulary included); null: a new drafter."""
    export_dtype: str = choice("bfloat16", DTYPES)
    """Dtype of the exported drafter's weights (export/drafter/): float32, bfloat16 or float16."""


@dataclass
class SftConfig:
    rows_per_step: int = bounded(16, ge=1)
    """fsdptrain sft: demonstration rows per step over all ranks (split into trainer.mini_batches_per_step optimizer
    steps; each packed into micro-batches of trainer.token_budget tokens: docs/sft.md)."""
    messages_key: str = "messages"
    """fsdptrain sft: the column holding a row's chat (a list of messages); without it a row is data.prompt_key and
    completion_key."""
    completion_key: str = "completion"
    """fsdptrain sft: the column holding the completion trained on, beside data.prompt_key (a string or messages)."""
    tools_key: str = "tools"
    """fsdptrain sft: the optional column of a chat's tool schemas, handed to the chat template."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    sft: SftConfig = field(default_factory=SftConfig)


SCHEMA_GROUPS = {
    "model": ModelConfig,
    "algorithm": AlgorithmConfig,
    "loss": LossConfig,
    "data": DataConfig,
    "reward": RewardConfig,
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "parallel": ParallelConfig,
    "logging": LoggingConfig,
    "perf": PerfConfig,
    "checkpoint": CheckpointConfig,
    "check": CheckConfig,
    "drafter": DrafterConfig,
    "sft": SftConfig,
}


def register_schemas() -> None:
    """Register the root schema; ``conf/config.yaml`` lists it first, so every YAML preset and override merged on top
    of it is type-checked (an unknown key or a wrong type fails composition)."""
    ConfigStore.instance().store(name="config_schema", node=Config)
