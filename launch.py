"""Compose, validate, place and launch an experiment.

    python launch.py                                   # tiny Llama, 2 CPU processes, MLflow run
    python launch.py +experiment=mixtral_ep8 launcher=plan
    python launch.py +experiment=tiny_llama_tp2
"""
from gridwright.cli import main

if __name__ == "__main__":
    main()
