"""ember.core.step_fns: pure step builders, the losses they use, and sampling.

Public names: `train_step`, `eval_step`, `split_microbatches`, `StatisticLeaves`, `TokenLoss`,
`cross_entropy`, `chunked_cross_entropy`, `token_logps`, `chunked_token_logps`, `sequence_logps`,
`SequenceLogps`, `preference_losses`, `PreferenceLosses`, `sample_token`, `generate`. The outer loop (`train_loop`,
`evaluate`) is run machinery: `ember.launch.loop`.
"""

from .chunked_loss import chunked_cross_entropy as chunked_cross_entropy
from .eval_step import eval_step as eval_step
from .preference_losses import PreferenceLosses as PreferenceLosses
from .preference_losses import preference_losses as preference_losses
from .losses import cross_entropy as cross_entropy
from .token_loss import TokenLoss as TokenLoss
from .sample import generate as generate
from .sample import sample_token as sample_token
from .sequence_logps import SequenceLogps as SequenceLogps
from .sequence_logps import chunked_token_logps as chunked_token_logps
from .sequence_logps import sequence_logps as sequence_logps
from .sequence_logps import token_logps as token_logps
from .statistic_leaves import StatisticLeaves as StatisticLeaves
from .train_step import split_microbatches as split_microbatches
from .train_step import train_step as train_step

__all__ = [
    "PreferenceLosses",
    "SequenceLogps",
    "StatisticLeaves",
    "TokenLoss",
    "chunked_cross_entropy",
    "chunked_token_logps",
    "cross_entropy",
    "eval_step",
    "generate",
    "preference_losses",
    "sample_token",
    "sequence_logps",
    "split_microbatches",
    "token_logps",
    "train_step",
]
