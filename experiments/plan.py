"""Plan a run before booking the cluster: which configurations of a model fit your GPUs, and how
fast each will go (experiments/sweeps/plan.py does the work).

    python experiments/plan.py model=gpt_7b cluster=dgx2_v100 gpus=8
    python experiments/plan.py model=gpt_7b cluster=dgx_h100 gpus=8 global_batch=256
    python experiments/plan.py model.layers=40 model.hidden=5120 model.heads=40 cluster=dgx_h100 gpus=64
    python experiments/plan.py model=llama3_8b cluster=dgx_h100 gpus=8     # GQA, SwiGLU, RMSNorm, rope, untied
    python experiments/plan.py cluster=local device_memory_gb=24 gpus_per_node=4 gpus=8   # no profile: memory only
    python experiments/plan.py deepspeed_config=conf/deepspeed/zero2_fp16.json gpus=8                      # what the JSON sets is fixed

Every ZeRO stage, TP degree, micro-batch, recomputation on/off and ZeRO-R Pa / Pa+cpu (TP > 1)
is priced by the analytic memory model and the step-time model; the fastest candidates are then
simulated at full world size until `confirm` of them fit, on what PyTorch's caching allocator
would reserve; a row not simulated fits on its analytic peak times the largest reserved / tensor
ratio the simulated ones showed (reserved_source). Prints the best rows that fit and the
nearest that do not, each with the command that runs it, and writes plan.md and plan.csv under
results_dir/plan/<model>-<cluster>-g<gpus>/. Bad input: one line on stderr, exit code 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
from omegaconf import DictConfig

from experiments.cli import exit_on_interrupt, preflight_or_exit
from experiments.points import ConfigError
from experiments.schema import register
from experiments.sweeps.plan import candidate_points, check_plan_config, run_plan

register()


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
@exit_on_interrupt("the points simulated so far are kept; the same command again reuses them")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    try:
        runtime = HydraConfig.get().runtime   # model=<name>: the config the printed commands start from
        _, text = run_plan(cfg, Path(runtime.cwd) / cfg.results_dir, base_model=runtime.choices.get("model"))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(text)


def _validate(cfg: DictConfig, remote: bool) -> None:
    check_plan_config(cfg)
    candidate_points(cfg)


if __name__ == "__main__":
    preflight_or_exit("plan", sys.argv[1:], _validate)
    main()
