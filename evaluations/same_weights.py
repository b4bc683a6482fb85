"""One draw of a model's weights for every engine: a Hugging Face folder and its verified
Megatron-Core conversion, so that runs of both engines start from the very same weights.

    python -m gridwright.evaluations.same_weights [--out same_weights] [OVERRIDE ...]

The weights are drawn by Megatron-Core's initialisation rules (the DeepSpeed engine's own
draw); the overrides compose the experiment whose model is drawn (default: the engines
comparison, `+bench=engines_base`). The engines_* presets load them from
`$GRIDWRIGHT_SAME_WEIGHTS` (default `same_weights`): `<model>_hf` for DeepSpeed's Hugging
Face model, `<model>_megatron` for Megatron-Core's GPTModel.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def write_same_weights(out: Path, experiment: list[str]) -> dict[str, Path]:
    """One draw of the bench model by Megatron-Core's initialisation rules, saved as a
    Hugging Face folder and converted (verified) to a Megatron-Core checkpoint, so that every
    engine starts from the very same weights: {"hf": folder, "megatron": checkpoint}."""
    import torch
    import transformers

    from gridwright.config.compose import compose_config
    from gridwright.engines.hf_model import hf_config, initialise_as_megatron
    from gridwright.planning.layout import ParallelLayout

    cfg = compose_config(experiment)
    name = cfg.model.name
    hf, megatron = out / f"{name}_hf", out / f"{name}_megatron"
    if hf.is_dir() and megatron.is_dir():  # drawn by an earlier invocation
        print(f"same weights: reusing {hf} and {megatron}", flush=True)
        return {"hf": hf, "megatron": megatron}
    torch.manual_seed(cfg.train.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg.model))
    initialise_as_megatron(model, cfg, ParallelLayout.from_config(cfg))
    model.save_pretrained(hf)
    subprocess.run([sys.executable, "-m", "gridwright.adapters.convert", "hf-to-megatron", "--hf", str(hf),
                    "--out", str(megatron), "--name", cfg.model.name, "--verify"], check=True)
    return {"hf": hf, "megatron": megatron}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("GRIDWRIGHT_SAME_WEIGHTS", "same_weights")))
    ap.add_argument("overrides", nargs="*", default=["+bench=engines_base"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for kind, path in write_same_weights(args.out, args.overrides).items():
        print(f"{kind:9} {path}")


if __name__ == "__main__":
    main()
