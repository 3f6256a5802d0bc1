"""The typed configuration schema, registered with hydra's ConfigStore.

Every group of ``conf/`` has a dataclass here; each field carries a one-line attribute docstring (the string literal
right below it), which ``docs/configuration.md`` mirrors and a test keeps in step. Choices are plain strings (an Enum
would reject the hyphenated names users type, such as ``token-sum``); :mod:`fsdptrain.config.validate` checks them
right after composition. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from fsdptrain.registry.constants import KL_CLAMP

ATTN_BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa_segments")
ALGORITHM_NAMES = ("ppo", "grpo")
DTYPES = ("float32", "bfloat16", "float16")
LR_SCHEDULES = ("constant", "cosine")
DATA_SOURCES = ("task", "jsonl", "prompts")
LONG_PROMPTS = ("skip", "error")
LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")
TASKS = ("repeat_digit", "copy_digits", "reverse_digits", "sort_digits")
DEVICES = ("auto", "cpu", "cuda")
RESUME_MODES = ("never", "auto")
VALUE_INITS = ("policy", "seed", "reward_model")
REWARD_MODEL_NORMALIZE = ("none", "batch", "running")
MODEL_ARCHS = ("llama", "qwen2", "mistral")
GATHER_MODES = ("auto", "always", "never")
RECOMPUTE_MODES = ("auto", "always")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local Hugging Face model folder (weights + config + tokenizer); null builds the tiny model below from its config."""
    arch: str = "llama"
    """Architecture of the config-built model when `path` is null."""
    hidden_size: int = 64
    """Hidden width of the config-built model."""
    num_layers: int = 2
    """Decoder layers of the config-built model."""
    num_heads: int = 4
    """Attention heads of the config-built model."""
    num_kv_heads: int = 2
    """Key/value heads of the config-built model (grouped-query attention when below num_heads)."""
    intermediate_size: int = 128
    """MLP width of the config-built model."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output projection (config-built model)."""
    attn_backend: str = "auto"
    """Packed attention for training forwards: auto, flash_attn, torch_varlen or sdpa_segments (generation uses sdpa)."""
    value_init: str = "policy"
    """Where the value model's backbone starts: policy (copy of the policy's weights), seed (fresh init) or reward_model (the first of reward.models)."""


@dataclass
class AlgorithmConfig:
    name: str = "ppo"
    """Preset name, for the record: ppo or grpo."""
    adv_estimator: str = "gae"
    """Advantage estimator: gae (needs the value model), grpo, rloo, reinforce_plus_plus(_baseline), or a user's
    module:function / path.py:function (docs/algorithms.md)."""
    use_critic: bool = True
    """Train a value model (PPO). GAE requires it."""
    gamma: float = 1.0
    """Discount for GAE."""
    lam: float = 1.0
    """GAE lambda."""
    whiten_advantages: bool = True
    """Whiten GAE advantages with mean and variance taken over the whole global batch."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's standard deviation (false gives Dr. GRPO's mean-only baseline)."""
    ppo_epochs: int = 1
    """Passes over each step's experience."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio lower bound is 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio upper bound is 1 + clip_ratio_high."""
    clip_ratio_c: Optional[float] = 3.0
    """Dual-clip bound for negative advantages (> 1); null turns dual-clip off."""
    seq_level_ratio: bool = False
    """Use the sequence-level importance ratio (GSPO) instead of the per-token one."""
    cliprange_value: float = 0.2
    """Value clipping range around the old values."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the policy loss."""
    use_kl_loss: bool = False
    """Add a KL penalty to a frozen reference policy to the loss (builds the reference model)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2, k3 (low variance), abs, mse, k1+ or k3+ (straight-through; docs/algorithms.md)."""
    kl_clamp: Optional[float] = KL_CLAMP
    """Bound on the value of the k3 and k3+ estimators (verl's 10); null for no clamp."""
    policy_loss: str = "vanilla"
    """Policy-gradient term: vanilla (PPO clip), cispo, gmpo, dro, or a user's module:function / path.py:function."""
    dro_beta: float = 1.0
    """DRO's quadratic penalty weight (policy_loss=dro; > 0)."""
    rollout_correction: str = "none"
    """Off-policy correction from behaviour log-probs: none, tis (truncated) or mis (masked importance weights)."""
    rollout_correction_level: str = "token"
    """Importance weights per token or per sequence (product of the token ratios)."""
    rollout_correction_cap: float = 2.0
    """Upper bound C of the importance weights (tis truncates to C, mis zeroes a weight above C)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop prompt groups whose samples all got the same reward."""
    filter_groups_max_rounds: int = 3
    """Dynamic sampling: generation rounds per step at most, until rollout.prompts_per_step groups are useful."""
    kl_in_reward_coef: float = 0.0
    """Per-token KL penalty subtracted from the reward (0 turns it off; needs the reference model)."""
    recompute_old_logprobs: str = "auto"
    """Old log-probs: auto skips their pass when the update is strictly on-policy (exact), always recomputes."""


@dataclass
class LossConfig:
    agg_mode: str = "token-mean"
    """Loss aggregation: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-sum-norm, seq-mean-token-mean."""
    loss_scale_factor: Optional[float] = None
    """Constant divisor of seq-mean-token-sum-norm; null uses the configured maximum response length."""
    logprob_chunk_size: int = 256
    """Tokens per chunk of the fused output projection (bounds the logits held at once)."""


@dataclass
class DataConfig:
    source: str = "task"
    """Where experience comes from: task (a bundled digit task), prompts (your prompt files) or jsonl (offline rollouts)."""
    task: str = "repeat_digit"
    """Bundled task when source=task: repeat_digit, copy_digits, reverse_digits or sort_digits."""
    num_rows: int = 4096
    """source=task: training rows generated from data.seed (visited epoch by epoch like a prompt file's rows)."""
    path: Any = None
    """source=prompts: a local .jsonl/.json/.parquet/.csv file, a list of them, or a save_to_disk folder; source=jsonl: the rollouts file."""
    prompt_key: str = "prompt"
    """source=prompts: the column holding the prompt (a string, or a chat: a list of {role, content} messages)."""
    eval_path: Any = None
    """source=prompts: held-out prompts for the greedy evaluation (same formats as path); null holds out data.eval_size rows of path."""
    eval_size: int = 32
    """source=prompts without eval_path: rows held out of path for the greedy evaluation (never trained on); 0 for none."""
    max_prompt_length: Optional[int] = None
    """source=prompts: prompts with more tokens are skipped and counted (or an error, see long_prompts); null keeps all."""
    long_prompts: str = "skip"
    """source=prompts: what a prompt over max_prompt_length does: skip (counted) or error."""
    max_response_length: Optional[int] = None
    """Declared maximum response length of offline rollouts (required for source=jsonl)."""
    skip_bad_rows: bool = False
    """Offline data: skip and count malformed rows instead of stopping with an error."""
    num_eval_prompts: int = 32
    """source=task: held-out prompts for the greedy evaluation reward."""
    seed: int = 1234
    """Seed of the prompt order (and of the bundled task's rows and the held-out split)."""


@dataclass
class RewardConfig:
    functions: Optional[list[str]] = None
    """Reward functions: built-in names (exact_match, math, think_format, word_match), module:function or path.py:function; null means word_match (the bundled tasks' reward)."""
    weights: Optional[list[float]] = None
    """One weight per function; null weighs each 1.0. A sample's reward is the weighted sum over the functions that applied."""
    num_workers: int = 0
    """Worker processes per rank that run the functions (0: in the training process, once per step)."""
    timeout_s: Optional[float] = None
    """Longest one call may run (needs num_workers >= 1); a timed-out call scores timeout_score. null: no limit."""
    timeout_score: float = 0.0
    """Score of each sample whose call timed out (counted in reward/<function>/num_timed_out)."""
    models: list[str] = field(default_factory=list)
    """Local folders of learned reward models (sequence classifiers, one label); their weighted scores add to the functions' total (docs/reward-models.md)."""
    model_weights: Optional[list[float]] = None
    """One weight per reward model; null weighs each 1.0."""
    model_normalize: str = "none"
    """Scaling of each reward model's scores: none, batch (whitened over the step's global batch) or running (running moments, kept in checkpoints)."""
    model_clip: Optional[float] = None
    """Clamp each normalised reward-model score to [-model_clip, model_clip]; null: no clipping."""
    model_offload: bool = False
    """Keep the reward models' shards on the CPU between scoring phases (a GPU run's memory saver)."""


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16
    """Prompts per training step, across all ranks."""
    n: int = 4
    """Samples per prompt (a group; never split across ranks)."""
    max_new_tokens: int = 6
    """Largest response length generated."""
    temperature: float = 1.0
    """Sampling temperature (log-probs in training use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    gather_weights: str = "auto"
    """Generate with the policy all-gathered once per step: auto (when it fits in free memory), always or never."""
    gather_weights_max_share: float = 0.5
    """gather_weights=auto gathers when the unsharded policy needs at most this share of free memory."""


@dataclass
class TrainerConfig:
    steps: Optional[int] = None
    """Number of training steps; null means 100, or the steps trainer.epochs gives when that is set."""
    epochs: Optional[float] = None
    """Instead of steps (data=task or prompts): passes over the training rows, steps = ceil(epochs x rows / rollout.prompts_per_step)."""
    seed: int = 0
    """Seed for model init and sampling."""
    mini_batches_per_step: int = 1
    """Optimizer steps per epoch: the step's prompt groups are split into this many mini-batches."""
    token_budget: int = 2048
    """Most tokens in one packed micro-batch on one rank."""
    lr: float = 3.0e-3
    """Policy learning rate (3e-3: the embedded default climbs steadily on 1 and 2 ranks; 5e-3 collapsed late on 2)."""
    critic_lr: float = 5.0e-3
    """Value model learning rate."""
    lr_schedule: str = "constant"
    """Learning-rate schedule after warmup: constant or cosine."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of the peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay (policy, critic and drafter optimizers)."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    grad_clip: float = 1.0
    """Policy gradient-norm clip (0 turns clipping off; the norm is still logged)."""
    critic_grad_clip: float = 1.0
    """Value model gradient-norm clip (0 turns clipping off)."""
    max_nonfinite_in_a_row: int = 3
    """Stop the run after this many consecutive steps skipped for a non-finite gradient norm."""
    grad_norm_warn_factor: float = 10.0
    """Warn when the pre-clip grad norm stays above this factor times the clip threshold for 5 steps."""
    eval_every: int = 25
    """Greedy evaluation every this many steps (0 turns it off)."""
    run_name: Optional[str] = None
    """Run name; null uses a timestamp. Naming it keeps the run directory stable across invocations."""
    run_dir: Optional[str] = None
    """Run directory; null means runs/<run_name> under the current directory."""
    resume: str = "never"
    """Resume: never, or auto (newest intact checkpoint of the run); a used run directory needs auto or overwrite."""
    overwrite: bool = False
    """Start over in a run directory that holds a run: delete its checkpoints, metrics and export first."""
    allow_config_change: bool = False
    """Resume even though the model, algorithm or loss mode changed (the change is recorded in the run directory)."""
    device: str = "auto"
    """Device: auto (cuda when available), cpu or cuda."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """HSDP replica groups (1 = plain FSDP)."""
    dp_shard: str = "auto"
    """Ranks each replica shards over; auto = world size / dp_replicate."""
    param_dtype: str = "float32"
    """Dtype of unsharded parameters in forward/backward (MixedPrecisionPolicy)."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduce-scatter (MixedPrecisionPolicy)."""
    reshard_after_forward: bool = True
    """Free unsharded parameters after each layer's forward (trades memory for an all-gather in backward)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU (GPU runs only)."""
    compile: bool = False
    """torch.compile each decoder layer before sharding, for the training forwards (docs/performance.md: when it pays)."""
    compile_backend: str = "inductor"
    """torch.compile backend with parallel.compile: inductor (generated kernels), aot_eager or eager (no codegen)."""


@dataclass
class LoggingConfig:
    progress: bool = True
    """Show a progress bar on rank 0."""
    backends: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where metrics go: jsonl (metrics.jsonl, always written), tensorboard, wandb, mlflow (each needs its library)."""
    samples_every: int = 10
    """Write a few prompts, completions and their rewards to samples.jsonl every this many steps (0 turns it off)."""


@dataclass
class PerfConfig:
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device in the param dtype for MFU; null: known GPUs auto, none on the CPU."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps (0 turns periodic checkpoints off)."""
    keep: int = 2
    """Keep this many newest checkpoints."""


@dataclass
class CheckConfig:
    rtol: float = 1.0e-5
    """check-metrics: relative tolerance of every comparison."""
    atol: float = 1.0e-6
    """check-metrics: absolute tolerance of every comparison."""
    simulated_dp: int = 2
    """check-metrics: data-parallel size simulated in one process."""
    num_prompts: int = 4
    """check-metrics: prompt groups in the checked mini-batch (at most rollout.prompts_per_step; >= the ranks)."""
    masked_fixture: bool = True
    """check-metrics: add a prompt-only sequence (no response token) so empty-extremum sentinels show."""
    negative_values: bool = True
    """check-metrics: shift the critic's outputs below zero for the check, so a 0.0 sentinel would win values_max."""


@dataclass
class DrafterConfig:
    enabled: bool = False
    """Co-train an EAGLE-3 drafter with the policy, in the same train step (docs/drafter.md)."""
    feature_layers: Optional[list[int]] = None
    """The three policy layers whose inputs feed the drafter (HF hidden_states indices); null: vLLM's default."""
    draft_vocab_size: Optional[int] = None
    """Tokens of the draft vocabulary (at most the policy's vocabulary); null: min(32000, the policy's vocabulary)."""
    vocab_path: Optional[str] = None
    """JSON file of the draft vocabulary's token ids (save_draft_vocab's format); null: built from the rollouts."""
    vocab_from_steps: int = 1
    """Without vocab_path: count the tokens of the first this many steps' rollouts; the drafter trains from then on."""
    on: str = "response"
    """Which predicted tokens train the drafter: response (response tokens only) or all."""
    loss_weight: float = 1.0
    """Weight of the draft loss in loss = policy_loss + loss_weight * draft_loss."""
    lr: Optional[float] = None
    """The drafter's AdamW learning rate (its own optimizer, the policy's schedule); null: max(1e-4, trainer.lr)."""
    weight_decay: float = 0.0
    """The drafter's AdamW weight decay."""
    refresh_passes: int = 0
    """Drafter-only passes per mini-batch after the policy's step, taught by the updated policy (docs/drafter.md)."""
    grad_clip: float = 1.0
    """Clip the drafter's gradient to this global L2 norm (its own clip; 0 turns clipping off)."""
    init_head_from_policy: bool = True
    """Start the draft head from the policy's output rows of the draft vocabulary."""
    num_layers: int = 1
    """Decoder layers of the drafter: the EAGLE-3 midlayer, then Llama layers (vLLM serves any; SGLang only 1)."""
    path: Optional[str] = None
    """Start from a saved drafter (an export/drafter/ folder, its vocabulary included); null: a new drafter."""
    export_dtype: str = "bfloat16"
    """Dtype of the exported drafter's weights (export/drafter/): float32, bfloat16 or float16."""


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
}


def register_schemas() -> None:
    """Register the root schema; ``conf/config.yaml`` lists it first, so every YAML preset and override merged on top
    of it is type-checked (an unknown key or a wrong type fails composition)."""
    ConfigStore.instance().store(name="config_schema", node=Config)
