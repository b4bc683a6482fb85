"""The one door to DeepSpeed internals: every repair, private call, non-public module and
file-layout fact gridwright depends on, and the private torch call its DeepSpeed path
makes, behind a version check.

Importing this package (or any module in it) refuses a DeepSpeed other than the tested
release (`gridwright.versions.deepspeed_version`), unless GRIDWRIGHT_UNTESTED_DEEPSPEED=1 lets a
user try anyway, with a warning. Modules:

    universal         the universal checkpoint: the state its converter needs, the
                      converter's command line, and the repair of DeepSpeed's ZeRO-3 load
    checkpoint_files  DeepSpeed's checkpoint files: which hold ZeRO partitions, how the
                      whole model is read from them, the classes their pickles name
    engine_state      what is read off an engine beyond its documented API (its
                      data-parallel group, its count of skipped steps)
    extensions        which of DeepSpeed's C++ ops a run will compile on first use

Each names the upstream lines it stands on in its module's `CITED` list, as (path under
site-packages, line); tests/test_deepspeed_internals.py checks that every cited line is
still in the installed DeepSpeed (and torch), so an upgrade that changes one fails the
test. Public DeepSpeed API (`deepspeed.initialize`, the engine's forward, backward,
step, save and load) is used directly by the engines. Modules import DeepSpeed lazily:
importing the fence costs only the version check.
"""
from ..versions.deepspeed_version import refuse_untested

refuse_untested()
