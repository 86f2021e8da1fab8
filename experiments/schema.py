"""Typed configuration of the experiment apps (Hydra structured configs).

The YAML files under conf/ are merged into these dataclasses, so a misspelled key or a value of
the wrong type is rejected by Hydra before anything runs; value checks that types cannot express
(TP divides the heads, enough local devices...) live in points.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore

from zero_impl import ZeroConfig


@dataclass
class ModelConfig:
    """A GPT shape (conf/model/<name>.yaml)."""

    name: str = "???"
    layers: int = "???"  # type: ignore[assignment]
    hidden: int = "???"  # type: ignore[assignment]
    heads: int = "???"   # type: ignore[assignment]
    seq_len: int = 1024
    vocab_size: int = 50257
    # Llama / MPT choices; the defaults are GPT-2's, the paper's model (models/gpt_shape.py GPTShape)
    ffn_hidden: Optional[int] = None   # the MLP's width (None: 4 x hidden)
    kv_heads: Optional[int] = None     # grouped-query attention's key/value heads (None: heads)
    bias: bool = True                  # biases in the linear layers
    position: str = "learned"          # learned | rope
    mlp: str = "gelu"                  # gelu | swiglu
    norm: str = "layernorm"            # layernorm | rmsnorm
    tie_embeddings: bool = True        # false: an output layer of its own (V x h)
    label: str = ""      # the paper's printed size, e.g. "100B"
    source: str = ""     # where the paper uses it


@dataclass
class ClusterConfig:
    """Where points run (conf/cluster/<name>.yaml)."""

    name: str = "local"
    gpus_per_node: Optional[int] = None       # None: detect (local); CPU processes when no GPU
    max_cpu_ranks: int = 8                    # local CPU runs: at most this many ranks per point
    device_memory_gb: Optional[float] = None  # per GPU, for "fits" predictions
    cuda_reserve_gb: float = 0.0              # per GPU, not tensors: CUDA context and workspaces (simulate=true's "fits")
    peak_tflops: Optional[float] = None       # per GPU, half precision dense
    inter_node_gbps: Optional[float] = None   # per node, all NICs together (Gbit/s)
    # the step-time model's constants (experiments/analysis/hardware.py, sourced there)
    sms: Optional[int] = None                    # streaming multiprocessors (GEMM wave quantization)
    gemm_ceiling: Optional[float] = None         # fraction of peak_tflops a large GEMM reaches
    hbm_gb_per_s: Optional[float] = None         # device memory bandwidth
    hbm_fraction: Optional[float] = None         # fraction of it a streaming (elementwise) kernel reaches
    kernel_floor_us: Optional[float] = None      # per kernel: launch + framework host overhead
    nvlink_links: Optional[int] = None           # NVLink links per GPU (NCCL's intra-node channels)
    nvlink_link_gb_per_s: Optional[float] = None  # per link per direction, as NCCL assigns it
    nics_per_node: Optional[int] = None          # inter-node NICs per node (inter_node_gbps is all of them)
    pcie_gb_per_s: Optional[float] = None        # host <-> device per GPU, per direction, achievable
    compute_capability: Optional[int] = None     # 70 Volta, 80 Ampere, 90 Hopper: NCCL's and the GEMM tiles' generation
    # what one node writes to the checkpoint file system while every node of the job writes
    # (GB/s): an assumption per cluster (conf/cluster/*.yaml says whose); None: not checked
    checkpoint_write_gb_per_s: Optional[float] = None
    description: str = ""


@dataclass
class ZeroSettings:
    """Engine knobs common to every point: zero_impl.ZeroConfig's names and defaults, except
    clipping, on at 1.0 as in the paper's runs."""

    reduce_bucket_size: int = ZeroConfig.reduce_bucket_size
    allgather_bucket_size: int = ZeroConfig.allgather_bucket_size
    optimizer_bucket_size: Optional[int] = ZeroConfig.optimizer_bucket_size  # None: the whole shard in one update
    overlap_comm: bool = ZeroConfig.overlap_comm
    clip_grad_norm: float = 1.0
    stage3_max_live_units: int = ZeroConfig.stage3_max_live_units
    stage3_prefetch_bucket_size: int = ZeroConfig.stage3_prefetch_bucket_size
    stage3_param_persistence_threshold: int = ZeroConfig.stage3_param_persistence_threshold
    stage3_keep_root: bool = ZeroConfig.stage3_keep_root  # false: the paper's schedule, every unit gathered twice (3Ψ)
    force_collectives: bool = ZeroConfig.force_collectives  # collectives even at world 1 (make gpu-check)
    gloo_point_to_point: bool = ZeroConfig.gloo_point_to_point  # gloo: exchanges for reduce-scatters, all-gathers
    # fp16's loss scaling (a DeepSpeed JSON's fp16 block sets them; DeepSpeed's hysteresis is 2)
    loss_scale: float = ZeroConfig.loss_scale                    # 0: dynamic
    initial_scale_power: int = ZeroConfig.initial_scale_power
    loss_scale_window: int = ZeroConfig.loss_scale_window
    min_loss_scale: float = ZeroConfig.min_loss_scale
    hysteresis: int = ZeroConfig.hysteresis
    consecutive_hysteresis: bool = ZeroConfig.consecutive_hysteresis
    # ZeRO-R (zero_impl/activations.py); an experiment's point sets them with `zero_r: C1`...`C5`
    partition_activations: bool = ZeroConfig.partition_activations    # Pa
    cpu_checkpointing: bool = ZeroConfig.cpu_checkpointing            # Pa+cpu
    contiguous_memory_optimization: bool = ZeroConfig.contiguous_memory_optimization  # MD
    number_checkpoints: Optional[int] = None                          # MD's arena slots (None: one per layer)


@dataclass
class TrainSettings:
    """How each point trains: the paper's recipe (Adam, lr 1.5e-4, wd 0.01, clip 1.0, one
    activation checkpoint per layer) on deterministic synthetic tokens."""

    precision: str = "auto"       # auto: fp32 on CPU, bf16 on GPUs that have it, else fp16
    recompute: bool = True
    grad_accum_steps: int = 1
    warmup_steps: int = 2
    steps: int = 5
    lr: float = 1.5e-4
    weight_decay: float = 0.01
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    seed: int = 1234
    timeout_s: float = 600.0      # per point, start-up included
    fault: str = "none"           # none | raise, hang (rank 0) | raise_last_rank, hang_last_rank | slow (+1 s a step)
    checkpoint_every: int = 0     # save a checkpoint every N steps (0: only when the launcher asks to stop)
    resume: bool = False          # start from the latest complete checkpoint under checkpoint_dir, if any
    checkpoint_dir: str = ""      # "": <results_dir>/<experiment>/checkpoints/<checkpoint id> (the point id less train.steps)
    layer_spec: str = "local"     # local: megatron's own layers; transformer_engine: TE's fused ones
    # Slurm's warning before the time limit, in which the ranks finish a step and checkpoint:
    # #SBATCH --signal=B:USR1@<this> in slurm/run_*.sh (a test checks they agree)
    stop_signal_lead_s: int = 600


@dataclass
class PointSpec:
    """One benchmark point as listed by an experiment."""

    model: str = "???"
    stage: int = "???"        # type: ignore[assignment]
    gpus: int = "???"         # type: ignore[assignment]
    tp: int = 1
    micro_batch: int = "???"  # type: ignore[assignment]
    note: str = ""            # e.g. the paper row it reproduces
    zero_r: str = ""          # Table 3's configuration, C1-C5: sets zero.* ZeRO-R switches (its stage must match)
    zero: Dict[str, Any] = field(default_factory=dict)  # this point's own zero.* values (ZeroConfig keys)


@dataclass
class GridSpec:
    """A cartesian product of points (used when an experiment lists no explicit points)."""

    model: list[str] = field(default_factory=list)
    stage: list[int] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    tp: list[int] = field(default_factory=lambda: [1])
    micro_batch: list[int] = field(default_factory=lambda: [2])


@dataclass
class ExperimentConfig:
    """conf/experiment/<name>.yaml: the grid of one paper artefact."""

    name: str = "???"
    description: str = ""
    paper: str = ""                                   # e.g. "Figure 2 (appendix Table 5)"
    points: list[PointSpec] = field(default_factory=list)
    grid: GridSpec = field(default_factory=GridSpec)


@dataclass
class SweepConfig:
    """experiments/sweep.py. The top-level stage/gpus/tp/micro_batch, when given (a value or a
    list), replace that axis of every point of the experiment; `model=<name>` (a config group
    option) replaces its models."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    model: Optional[ModelConfig] = None
    stage: Any = None
    gpus: Any = None
    tp: Any = None
    micro_batch: Any = None
    dry_run: bool = False
    force: bool = False
    results_dir: str = "results/runs"
    launcher: str = "auto"    # auto | fork | spawn | torchrun: how local ranks are started
    simulate: bool = False    # play one rank of each point's full world on fake tensors (experiments/run/fake.py)
    simulate_rank: int = 0    # the rank simulate=true plays
    simulate_workers: int = 0  # points simulated at once (0: the CPU count)
    ignore_host_memory: bool = False  # run points whose predicted memory exceeds what this host has available (points.check_host_memory)
    simulate_largest: bool = False  # with simulate: search each row's model family for the most layers that fit (experiments/sweeps/largest.py)
    deepspeed_config: str = ""      # a DeepSpeed JSON: its stage, batch, precision, optimizer and engine knobs (zero_impl.deepspeed)


@dataclass
class TrainConfig:
    """experiments/train.py: one point, run by torchrun, srun or a sweep."""

    model: ModelConfig = field(default_factory=ModelConfig)
    stage: int = 2
    gpus: int = 1
    tp: int = 1
    micro_batch: int = 2
    experiment_name: str = "adhoc"   # the folder under results_dir (not the experiment config group)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    results_dir: str = "results/runs"
    simulate: bool = False    # play rank simulate_rank of the point's full world on fake tensors, in this process
    simulate_rank: int = 0
    ignore_host_memory: bool = False  # run even when the predicted memory exceeds what this host has available (points.check_host_memory)
    deepspeed_config: str = ""  # a DeepSpeed JSON: its stage, batch, precision, optimizer and engine knobs (zero_impl.deepspeed)


@dataclass
class PredictConfig:
    """experiments/predict.py: the step-time model on one point (model=, stage=, gpus=, tp=,
    micro_batch=, cluster=) or on every point of a paper experiment (experiment=fig2)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    experiment: Optional[ExperimentConfig] = None
    # the point's axes; None: predict.py's defaults for a point, the experiment's own for experiment=
    stage: Optional[int] = None
    gpus: Optional[int] = None
    tp: Optional[int] = None
    micro_batch: Optional[int] = None
    system: Optional[str] = None   # None: zero_repro for a point, the paper's system for a paper point
    format: str = "table"          # table | json
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    zero: ZeroSettings = field(default_factory=ZeroSettings)


@dataclass
class PlanConfig:
    """experiments/plan.py: every configuration of `model` on `gpus` GPUs of `cluster` (ZeRO
    stage, TP, micro-batch, recomputation, ZeRO-R's Pa / Pa+cpu), its memory (analytic, then
    simulated for the best candidates) and its predicted speed, best first."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    gpus: int = 8
    device_memory_gb: Optional[float] = None   # replaces the cluster's (a cluster without a profile needs it)
    gpus_per_node: Optional[int] = None        # likewise: TP stays inside a node
    global_batch: Optional[int] = None         # sequences per step, fixed: accumulation fills micro x DP up to it
    stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    tps: Optional[list[int]] = None            # TP degrees to consider (None: every one that divides, within a node)
    micro_batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    recompute: list[bool] = field(default_factory=lambda: [True, False])
    system: str = "zero_repro"     # whose step the speed is predicted for (analysis/systems.py)
    confirm: int = 3               # simulate until this many of the fastest candidates are confirmed to fit
    max_simulations: int = 12      # at most this many simulated ranks per plan
    simulate_workers: int = 0      # simulations at once (0: the CPU count)
    simulate_rank: int = 0
    top: int = 10                  # rows printed (plan.csv has them all)
    results_dir: str = "results/runs"
    name: str = ""                 # the plan's folder under results_dir/plan/ ("": <model>-<cluster>-g<gpus>)
    deepspeed_config: str = ""     # a DeepSpeed JSON: its keys fix what they set (zero_impl.deepspeed)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="plan_schema", node=PlanConfig)
    cs.store(name="predict_schema", node=PredictConfig)
    cs.store(name="sweep_schema", node=SweepConfig)
    cs.store(name="train_schema", node=TrainConfig)
