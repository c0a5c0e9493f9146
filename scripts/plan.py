#!/usr/bin/env python3
"""Predict every memory preset for a run without running anything: peak GPU memory, pinned host memory (offload),
step time, tokens/s per GPU, whether it fits, and what memory=auto would choose.

    python scripts/plan.py model=llama3_2_1b data=synthetic precision=bf16 data.seq_len=262144 parallelism.cp=1
    python scripts/plan.py model=llama3_1_8b_shape precision=bf16 data=synthetic data.seq_len=4194304 \\
        parallelism.cp=8 plan.gpus=8 plan.gpu_gib=140 plan.host_gib=2000

The same Hydra overrides as scripts/train.py, plus:
    plan.gpus=N           the world size (default: parallelism.cp)
    plan.gpus_per_node=K  ranks sharing one host's memory for offload (default: min(N, 8))
    plan.gpu_gib=G        memory per GPU in GiB (default: memory.auto_gpu_gib, else 140, an H200 as torch reports it)
    plan.host_gib=H       host memory per node in GiB (default: memory.auto_host_gib, else this machine's)
    plan.device=gpu|cpu   gpu (default): the run's GPU kernels (fused per-token kernels; FA4 for attn_backend=auto
                          when flash_attn.cute is installed here, else SDPA); cpu: HF's eager modules
Nothing is built and CUDA is never touched (the cost model: ds_ulysses_ext/memory/planner.py, docs/memory.md).
Exit status 1 when no preset fits, with the longest data.seq_len that would; 2 with the message alone when the
command line does not compose (a preset or key that does not exist) or the config would be refused.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra.errors import HydraException  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from configs import compose_config, validate  # noqa: E402
from configs.compose import check_overrides  # noqa: E402
from configs.errors import ConfigError  # noqa: E402
from engine.run.auto_memory import (FIT_FRACTION, TIE_FRACTION, host_total_gib, plan_caveats, plan_memory,  # noqa: E402
                                    refusal)

PLAN_KEYS = ("gpus", "gpus_per_node", "gpu_gib", "host_gib", "device")


def main(argv) -> int:
    plan_args = {}
    overrides = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("plan."):
            if key[5:] not in PLAN_KEYS:
                sys.exit(f"unknown {key}: plan.py takes {', '.join('plan.' + k for k in PLAN_KEYS)}")
            plan_args[key[5:]] = value
        else:
            overrides.append(arg)
    try:
        check_overrides(overrides)
        cfg = compose_config(overrides)
    except (ConfigError, HydraException, OmegaConfBaseException) as e:  # the message names it; a traceback would not
        print(f"plan.py: {e}", file=sys.stderr)
        return 2
    gpus = int(plan_args.get("gpus", cfg.parallelism.cp))
    per_node = int(plan_args.get("gpus_per_node", min(gpus, 8)))
    gpu_gib = float(plan_args.get("gpu_gib", cfg.memory.auto_gpu_gib or 140.0))
    host_gib = float(plan_args.get("host_gib", cfg.memory.auto_host_gib or host_total_gib()))
    on_gpu = plan_args.get("device", "gpu") == "gpu"
    try:
        validate(cfg, gpus)
    except ConfigError as e:
        print(f"this config would be refused on {gpus} rank(s): {e}")
        return 2
    plan = plan_memory(cfg, gpus, gpu_gib, host_gib, per_node, on_gpu)
    r = plan.run
    print(f"model {cfg.model.name}: data.seq_len={r.seq_len}, cp={r.cp}, micro-batch {r.micro_batch}, "
          f"{r.local_tokens} tokens per GPU; {gpus} GPU(s) of {gpu_gib:.0f} GiB, {per_node} per host of "
          f"{host_gib:.0f} GiB; ZeRO-{r.zero_stage}, master weights {r.master_weights}, attention {r.attn_backend}, "
          f"per-token kernels {r.kernels}")
    print(plan.table())
    for caveat in plan_caveats(cfg):
        print(f"note: {caveat}")
    if plan.choice is None:
        print(refusal(cfg, plan, gpus, on_gpu))
        return 1
    print(f"memory=auto would choose memory={plan.choice} (the fastest preset whose predicted peak is at most "
          f"{FIT_FRACTION:.0%} of the GPU; presets within {TIE_FRACTION:.0%} of the fastest time count as equally "
          "fast, and among them one without host memory wins, then the least GPU memory)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
