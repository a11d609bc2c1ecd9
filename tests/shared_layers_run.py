"""torchrun entry point: ``autopipe run`` on several plans of shared-layer models at once.

    torchrun --nproc-per-node 2 tests/shared_layers_run.py OUT_DIR CASE [CASE ...]

A case ``MODEL-TAG`` runs ``autopipe run tests/shared_layers_models.py:MODEL --plan
OUT_DIR/CASE.plan.json --steps 2 --lr 0.1`` through the CLI's own entry point, saving the
trained weights to ``OUT_DIR/CASE.ckpt``, the losses to ``OUT_DIR/CASE.json`` and the exit
code to ``OUT_DIR/CASE.rank<R>.rc``: one launch, torch and transformers imported once. Not a
test module (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MODELS = Path(__file__).resolve().with_name("shared_layers_models.py")


def main(out_dir: str, cases: list[str]) -> None:
    import torch
    from autopipe.runtime.distributed import init_distributed, shutdown

    from autopipe import cli

    torch.set_num_threads(1)
    init_distributed(timeout_s=60)
    rank = int(os.environ["RANK"])
    out = Path(out_dir)
    for case in cases:
        model = case.partition("-")[0]
        code = cli.main(
            [
                "run", f"{MODELS}:{model}", "--plan", str(out / f"{case}.plan.json"),
                "--steps", "2", "--lr", "0.1", "--timeout", "60", "-q",
                "--save", str(out / f"{case}.ckpt"), "--json", str(out / f"{case}.json"),
            ]
        )  # fmt: skip
        (out / f"{case}.rank{rank}.rc").write_text(str(code))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
