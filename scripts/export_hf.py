#!/usr/bin/env python3
"""Write an HF `save_pretrained` folder (safetensors + the run's tokenizer) from any checkpoint of a run.

    python scripts/export_hf.py outputs/demo                          # its latest checkpoint
    python scripts/export_hf.py outputs/demo --tag step_00000010 --out exported/step10

One CPU process, no launcher; it holds the fp32 weights and the model in host memory (about 6 bytes per
parameter for a bf16 model: 48 GB for 8B). For the final step the run's own export (`trainer.export_hf`,
`<run>/hf_export`) holds the same weights. This serves mid-run checkpoints, and a run that must go on where
its optimizer state cannot follow (e.g. onto one rank, engine/checkpoints/reshard.py): start a new run.out_dir with
model.source=pretrained model.path=<the export> (the optimizer starts fresh).

The model is built from the config the checkpoint was written with (its config.json), and the checkpoint is
verified against its manifest first: a damaged one is named with its file, and the export says which step and
config it holds (training.json). Exit status 2, with the message alone, when it cannot export.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from engine.checkpoints.checkpoint import DamagedCheckpoint  # noqa: E402
from engine.checkpoints.export import export_hf_from_checkpoint  # noqa: E402
from engine.run.refusal import full_errors  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run's run.out_dir (holds config.json and checkpoints/)")
    parser.add_argument("--tag", default=None, help="a checkpoint under checkpoints/, e.g. step_00000010 "
                        "(default: the one `latest` names)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the folder to write (default: <run_dir>/hf_export_<tag>)")
    args = parser.parse_args(argv)
    try:
        print(export_hf_from_checkpoint(args.run_dir, args.tag, args.out))
    except (DamagedCheckpoint, FileNotFoundError, NotImplementedError) as err:
        if full_errors():
            raise
        print(f"export_hf.py: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
