"""ember.core.step_fns: pure step builders, the losses they use, the outer loop and sampling.

Public names: `train_step`, `eval_step`, `split_microbatches`, `cross_entropy`, `train_loop`,
`evaluate`, `sample_token`, `generate`.
"""

from .eval_step import eval_step as eval_step
from .loop import evaluate as evaluate
from .loop import train_loop as train_loop
from .losses import cross_entropy as cross_entropy
from .sample import generate as generate
from .sample import sample_token as sample_token
from .train_step import split_microbatches as split_microbatches
from .train_step import train_step as train_step

__all__ = [
    "cross_entropy",
    "eval_step",
    "evaluate",
    "generate",
    "sample_token",
    "split_microbatches",
    "train_loop",
    "train_step",
]
