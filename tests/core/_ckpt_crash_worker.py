"""Save checkpoints asynchronously in a loop until killed (tests/core/test_checkpoint_resume.py).

    python tests/core/_ckpt_crash_worker.py CKPT_DIR

Resumes from the latest step in CKPT_DIR (or saves step 1 and waits for it), then forever: fills
every tensor with the step number, starts an async save of that step, prints `SAVING <step>`, and
keeps overwriting the tensors in place (as a donated training step does) while orbax writes. The
test kills it with SIGKILL at different moments of a save; every committed step must read back
filled with its own number.
"""

from __future__ import annotations

import sys

import torch

from ember.core.checkpoint import CheckpointManager

SHAPES = {"a": (1024, 2048), "b": (2048, 1024), "c": (512, 512)}  # ~17 MB: a save takes a few 100 ms


def state_at(step: int) -> dict:
    params = {k: torch.full(shape, float(step)) for k, shape in SHAPES.items()}
    return {"params": params, "step": torch.tensor(step), "half": torch.full((64,), float(step), dtype=torch.bfloat16)}


def main(directory: str) -> None:
    ckpt = CheckpointManager(directory, save_every=1, max_to_keep=2, async_save=True)
    step = ckpt.latest_step()
    if step is None:
        step = 1
        ckpt.save(step, state_at(step))
        ckpt.wait()
    print(f"READY {step}", flush=True)
    state = state_at(step)
    while True:
        step += 1
        for x in (*state["params"].values(), state["half"]):
            x.fill_(float(step))
        state["step"].fill_(step)
        ckpt.save(step, state)
        print(f"SAVING {step}", flush=True)
        for _ in range(3):  # "training" on the same buffers while the save is written
            for x in state["params"].values():
                x.mul_(1.0001)


if __name__ == "__main__":
    main(sys.argv[1])
