#!/usr/bin/env python3
"""Train an HF causal LM with exact context parallelism on DeepSpeed. Hydra app over hydra_conf/.

    # the CPU demo (the defaults): tiny Llama, shipped data, cp=2 on 2 ranks
    torchrun --standalone --nproc_per_node 2 scripts/train.py
    # GPUs, DeepSpeed launcher (--no_local_rank: Hydra rejects the --local_rank=N flag it would add)
    deepspeed --num_gpus 8 --no_local_rank scripts/train.py experiment=llama8b_8gpu_cp8_256k
    # any key can be overridden
    deepspeed --num_gpus 4 --no_local_rank scripts/train.py model=llama3_2_1b parallelism=cp4 data.seq_len=262144

Ranks come from the environment (RANK, WORLD_SIZE, LOCAL_RANK). Only rank 0 writes the resolved config.
A refused run (a key, a value, a checkpoint or the run folder that cannot go on as configured) prints its message
once, on rank 0, and exits with status 2, having written nothing; HYDRA_FULL_ERROR=1 shows each rank's traceback.
"""
import logging
import warnings
import sys
from pathlib import Path

# plain `deepspeed` (without --no_local_rank) appends --local_rank=N, which Hydra would reject
sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from configs import TrainConfig, register_configs, to_dataclass  # noqa: E402
from configs.compose import check_overrides  # noqa: E402
from engine.run.refusal import hush_other_ranks, hydra_started, reported  # noqa: E402

register_configs()
# DeepSpeed 0.19 still calls the collectives torch 2.13 renamed; the warning is theirs, not actionable here
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated", category=FutureWarning)


@hydra.main(version_base="1.3", config_path="../hydra_conf", config_name="train")
def main(dict_cfg: DictConfig) -> None:
    hydra_started()
    from engine.ds.distributed import exit_after_success
    with reported():  # a refusal: its message once, not a traceback per rank (Hydra would print each)
        run(to_dataclass(dict_cfg))  # from here on: typed dataclasses only
    exit_after_success()  # reached only when the run ended normally: groups destroyed, no finalisation


def run(cfg: TrainConfig) -> dict:
    """Everything after composition; tests call this with a composed config on forked ranks."""
    from engine.ds.distributed import init_distributed, read_runtime
    from engine.run.startup import prepare
    rt = read_runtime(cfg.device, cfg.dist_backend)
    cfg, plan = prepare(cfg, rt)  # validated, memory=auto resolved: before any model is loaded
    if rt.is_main:
        for message in plan.unread:  # keys the run accepted but will not read (configs/conditional.py)
            logging.getLogger("configs").warning(message)
    init_distributed(rt)
    from engine.run.train import train
    outputs = train(cfg, plan, rt)  # it writes config.json once nothing can refuse the run any more
    if rt.is_main:
        print("\n".join(f"{k}: {v}" for k, v in outputs.items()), flush=True)
    return outputs


if __name__ == "__main__":
    with reported():
        check_overrides(sys.argv[1:])  # a misspelt key, named with the field meant (Hydra's error would suggest +)
    hush_other_ranks()  # Hydra's own errors (a preset that does not exist) are the same on every rank
    main()
