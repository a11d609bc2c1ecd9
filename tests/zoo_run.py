"""torchrun entry point: ``autopipe run`` on several zoo plans in one process group.

    torchrun --nproc-per-node 2 tests/zoo_run.py [--models FILE] [--steps N] OUT_DIR FAMILY.CUT [...]

For each run ``FAMILY.CUT``, runs ``autopipe run tests/zoo.py:FAMILY --plan
OUT_DIR/FAMILY.CUT.plan.json --steps 2`` through the CLI's own entry point (the plan's
optimizer, SGD in the tests), saving the trained weights to ``OUT_DIR/FAMILY.CUT.ckpt`` and
the losses to ``OUT_DIR/FAMILY.CUT.json``; the exit code goes to
``OUT_DIR/FAMILY.CUT.rank<R>.rc``. ``--models FILE`` takes the factories from another model
file (tests/shared_layers_models.py), a run then named ``FACTORY-TAG``; ``--steps N``
trains N steps instead of 2 (the mesh tests: 3). One launch
for the whole zoo: every process imports torch and transformers once, not once per model.
Not a test module (no ``test_`` prefix). ``cli.main([...])`` in-process cannot re-execute
with a fixed ``PYTHONHASHSEED`` as ``python -m autopipe run`` does: the launcher sets one
(test_zoo.py), and ranks that trace different graphs are refused at start-up anyway.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ZOO = Path(__file__).resolve().with_name("zoo.py")


def main(out_dir: str, runs: list[str], models: Path = ZOO, steps: int = 2) -> None:
    import torch
    from autopipe.runtime.distributed import init_distributed, shutdown

    from autopipe import cli

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    rank = int(os.environ["RANK"])
    out = Path(out_dir)
    for run in runs:
        family = run.replace("-", ".").split(".")[0]
        code = cli.main(
            [
                "run", f"{models}:{family}", "--plan", str(out / f"{run}.plan.json"),
                "--steps", str(steps), "--lr", "0.1", "--timeout", "60", "-q",
                "--save", str(out / f"{run}.ckpt"), "--json", str(out / f"{run}.json"),
            ]
        )  # fmt: skip
        (out / f"{run}.rank{rank}.rc").write_text(str(code))
    shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    models, steps = ZOO, 2
    while args[0] in ("--models", "--steps"):
        if args[0] == "--models":
            models = Path(args[1])
        else:
            steps = int(args[1])
        args = args[2:]
    main(args[0], args[1:], models, steps)
    from autopipe.runtime.distributed import exit_process

    exit_process(0)  # Python's teardown can abort a rank after a clean run
