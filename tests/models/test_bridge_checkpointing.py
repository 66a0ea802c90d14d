"""A Hugging Face model with `gradient_checkpointing_enable()` trains under ember's compiled step.

transformers' checkpointing is `torch.utils.checkpoint` (saved-tensor hooks), which `torch.func.grad`
cannot differentiate; ember's `grad` takes the gradient with `torch.autograd.grad` inside the trace.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ember import optim
from ember.core import TrainState, random
from ember.core.jit import jit
from ember.core.step_fns import cross_entropy, train_step
from ember.models.bridge import from_torch

transformers = pytest.importorskip("transformers")

STEPS = 3


def _llama(checkpointing: bool):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                                   attention_dropout=0.0)
    hf = transformers.LlamaForCausalLM(cfg)
    if checkpointing:
        with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            hf.gradient_checkpointing_enable()
    hf.train()  # transformers checkpoints in training mode only; dropout is 0
    return from_torch(hf, eval_mode=False)


def _loss_of(model):
    def loss_fn(params, ids, *, key):
        logits = model.apply(params, input_ids=ids, use_cache=False).logits
        return cross_entropy(logits[:, :-1], ids[:, 1:])

    return loss_fn


def _losses(model, params, backend):
    state = TrainState.create(params=params, tx=optim.adamw(1e-2), key=random.key(0))
    step = jit(train_step(_loss_of(model)), backend=backend)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, torch.randint(0, 64, (4, 16), generator=g))
        losses.append(float(metrics["loss"]))
    return losses


def test_a_checkpointed_hf_model_trains_compiled_like_eager():
    model, params = _llama(checkpointing=True)
    assert model.module.model.gradient_checkpointing
    eager = _losses(model, params, "eager")
    compiled = _losses(model, params, "inductor")
    plain_model, plain_params = _llama(checkpointing=False)
    plain = _losses(plain_model, plain_params, "eager")
    assert compiled == pytest.approx(eager, abs=1e-5)
    assert eager == pytest.approx(plain, abs=1e-5)
    assert eager[-1] < eager[0]


def test_the_traced_step_recomputes_the_checkpointed_layers():
    # What lowers the compiled step's memory (0.53x at 4 layers, BENCHMARKS.md "One compile path"):
    # the backward in the traced graph runs each checkpointed layer's forward matmuls again.
    from ember.core.jit_backends.trace import trace_and_compile
    from ember.core.pytree import tree_flatten, tree_unflatten

    def matmuls(checkpointing: bool) -> int:
        model, params = _llama(checkpointing)
        state = TrainState.create(params=params, tx=optim.adamw(1e-2), key=random.key(0))
        leaves, spec = tree_flatten((state, torch.randint(0, 64, (4, 16))))
        step = train_step(_loss_of(model))

        def flat(*tensors):
            return tuple(tree_flatten(step(*tree_unflatten(list(tensors), spec)))[0])

        gm = trace_and_compile(flat, leaves)
        return sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) for n in gm.graph.nodes)

    plain, checkpointed = matmuls(False), matmuls(True)
    assert checkpointed > plain, (plain, checkpointed)
