"""Child-process measurement for `launch/bench_scale.py --bridged-checkpointing`.

Public names: `bridged_checkpointing_child`.

A transformers Llama bridged with `from_torch`, trained by ember's compiled step with and without
`gradient_checkpointing_enable()` (`torch.utils.checkpoint` inside the module).
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Dict

import torch

from ember import optim
from ember.core import TrainState, jit, pytree, random
from ember.core.step_fns import cross_entropy, train_step
from ember.models.bridge import from_torch

from .children import memory_peak


def _bridged_llama(checkpointing: bool, *, layers: int, hidden: int, vocab: int) -> Any:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 64), attention_dropout=0.0,
                                   bos_token_id=0, eos_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg)
    if checkpointing:
        with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            hf.gradient_checkpointing_enable()
    hf.train()  # transformers checkpoints in training mode only; dropout is 0
    return from_torch(hf, eval_mode=False)


def bridged_checkpointing_child(checkpointing: bool, *, layers: int, hidden: int, batch: int, seq: int,
                                vocab: int = 1024, steps: int = 3) -> Dict[str, Any]:
    """Transient memory at peak of the compiled step (after `steps` warm calls; as in `scaling.py`), and
    the first `steps` losses compiled and eager from the same start."""
    model, params = _bridged_llama(checkpointing, layers=layers, hidden=hidden, vocab=vocab)

    def loss_fn(p, ids, *, key):
        logits = model.apply(p, input_ids=ids, use_cache=False).logits
        return cross_entropy(logits[:, :-1], ids[:, 1:])

    batches = [random.randint(random.key(i), (batch, seq), 0, vocab) for i in range(steps)]
    losses = {}
    for backend in ("eager", "inductor"):
        fresh = pytree.tree_map(torch.clone, params)  # the compiled step donates (overwrites) its state
        state = TrainState.create(params=fresh, tx=optim.adamw(1e-3), key=random.key(0))
        step = jit(train_step(loss_fn), backend=backend, donate="state" if backend == "inductor" else "none")
        losses[backend] = []
        for ids in batches:
            state, metrics = step(state, ids)
            losses[backend].append(float(metrics["loss"]))
    gc.collect()
    out = []
    base, peak = memory_peak(lambda: out.append(step(state, batches[0])), cuda=False)
    return {"transient_bytes": peak - base, "eager_losses": losses["eager"], "compiled_losses": losses["inductor"]}
