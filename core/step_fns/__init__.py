"""ember.core.step_fns: pure step builders, the losses they use, and sampling.

Public names: `train_step`, `eval_step`, `split_microbatches`, `StatisticLeaves`, `TokenLoss`,
`cross_entropy`, `chunked_cross_entropy`, `sample_token`, `generate`. The outer loop (`train_loop`,
`evaluate`) is run machinery: `ember.launch.loop`.
"""

from .chunked_loss import chunked_cross_entropy as chunked_cross_entropy
from .eval_step import eval_step as eval_step
from .losses import cross_entropy as cross_entropy
from .token_loss import TokenLoss as TokenLoss
from .sample import generate as generate
from .sample import sample_token as sample_token
from .statistic_leaves import StatisticLeaves as StatisticLeaves
from .train_step import split_microbatches as split_microbatches
from .train_step import train_step as train_step

__all__ = [
    "StatisticLeaves",
    "TokenLoss",
    "chunked_cross_entropy",
    "cross_entropy",
    "eval_step",
    "generate",
    "sample_token",
    "split_microbatches",
    "train_step",
]
