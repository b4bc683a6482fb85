"""`python -m gridwright ARGS` is `python launch.py ARGS` (for installs without the repo)."""
from .cli import main

main()
