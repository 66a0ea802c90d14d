"""A DPO step's cost: ember's against TRL's on the same model and pairs, and against an SFT step of the same tokens.

    python launch/bench_dpo.py                              # Qwen2, d=256, 4 layers, vocab 4096; 8 pairs x 128 tokens
    python launch/bench_dpo.py --d-model 128 --layers 2 --pairs 4 --seq 64 --iters 5   # a quick look

One process, round-robin (`ember.launch.benchmark.time_round_robin`), AdamW everywhere, float32 on the CPU:

    trl             TRL's `DPOTrainer` on a transformers Qwen2 (the same weights): `_compute_loss` (policy forward
                    on chosen + rejected, reference forward, loss), backward, `optimizer.step`, `zero_grad`
    ember_eager     `train_step(dpo_loss(model))` eagerly, the reference in `TrainStateWithFrozen`
    ember           the same step compiled (`jit(backend="inductor")`)
    ember_precomp   compiled, the reference's log-probabilities precomputed into the batch (no reference forward)
    sft             compiled `train_step(lm_loss(model))` on the same 2 x pairs sequences (same tokens)

Prints each variant's median step time and the ratios the README and BENCHMARKS.md quote.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile


def _setup(d_model: int, layers: int, vocab: int, pairs: int, seq: int):
    import torch
    from ember.core import random
    from ember.models import build_model

    model = build_model("qwen2", "tiny", d_model=d_model, n_layers=layers, n_heads=max(d_model // 64, 2),
                        n_kv_heads=max(d_model // 128, 1), ffn_dim=4 * d_model, vocab_size=vocab,
                        max_seq_len=seq, tie_embeddings=False)
    params = model.init(random.key(0))
    ids = random.randint(random.key(1), (2 * pairs, seq), 0, vocab)
    completion = torch.zeros_like(ids)
    completion[:, seq // 4:] = 1  # a quarter prompt, the rest response, every row full
    return model, params, ids, completion


def _trl_variant(folder: str, ids, completion, lr: float):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    from trl import DPOConfig, DPOTrainer

    from ember.launch.benchmark import Variant

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0, "<eos>": 1, "<pad>": 2},
                                                                             unk_token="x")),
                                  eos_token="<eos>", pad_token="<pad>")
    load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")  # noqa: E731
    args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, bf16=False, learning_rate=lr,
                     weight_decay=0.0, beta=0.1)
    trainer = DPOTrainer(model=load(), ref_model=load(), args=args, processing_class=tok,
                         train_dataset=Dataset.from_list([{"prompt": "x", "chosen": "x", "rejected": "x"}]))
    trainer.create_optimizer()
    model, opt = trainer.model, trainer.optimizer
    model.train()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}

    def step():
        loss = trainer._compute_loss(model, batch, False)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Variant("trl", step, lambda: 0)


def _ember_variants(model, params, ids, completion, lr: float):
    import torch
    from ember import optim
    from ember.core import TrainState, TrainStateWithFrozen, jit, pytree
    from ember.core.step_fns import sequence_logps, train_step
    from ember.launch.benchmark import Variant
    from ember.models import dpo_loss, lm_loss, response_logps

    pairs = ids.shape[0] // 2
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = torch.where(completion[:, 1:].bool(), ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    batch = {"chosen_inputs": ids[:pairs], "chosen_targets": targets[:pairs],
             "rejected_inputs": ids[pairs:], "rejected_targets": targets[pairs:]}
    with torch.no_grad():
        ref = sequence_logps(response_logps(model, params, ids, targets)[0], targets).total
    precomputed = {**batch, "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}
    sft_batch = {"inputs": ids, "targets": targets}
    tx = optim.adamw(lr, weight_decay=0.0)
    copy = lambda: pytree.tree_map(torch.clone, params)  # noqa: E731

    def variant(name, step_fn, state, data):
        holder = {"state": state}

        def step():
            holder["state"], metrics = step_fn(holder["state"], data)
            return metrics["loss"]

        return Variant(name, step, lambda: 0)

    dpo = train_step(dpo_loss(model, beta=0.1), tx)
    with_ref = lambda: TrainStateWithFrozen.create(params=copy(), tx=tx, frozen=copy())  # noqa: E731
    return [variant("ember_eager", dpo, with_ref(), batch),
            variant("ember", jit(dpo, backend="inductor"), with_ref(), batch),
            variant("ember_precomp", jit(dpo, backend="inductor"), TrainState.create(params=copy(), tx=tx), precomputed),
            variant("sft", jit(train_step(lm_loss(model), tx), backend="inductor"),
                    TrainState.create(params=copy(), tx=tx), sft_batch)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-trl", action="store_true", help="ember's variants only")
    args = p.parse_args(argv)

    import torch
    from ember.launch.benchmark import time_round_robin
    from ember.models import to_hf

    torch.manual_seed(0)
    model, params, ids, completion = _setup(args.d_model, args.layers, args.vocab, args.pairs, args.seq)
    variants = _ember_variants(model, params, ids, completion, 1e-5)
    if not args.no_trl:
        folder = tempfile.mkdtemp()
        to_hf(model, params, folder)
        variants.insert(0, _trl_variant(folder, ids, completion, 1e-5))
    times = time_round_robin(variants, warmup=args.warmup, iters=args.iters)
    median = {name: statistics.median(r["times"]) for name, r in times.items()}
    print(f"Qwen2 d={args.d_model} layers={args.layers} vocab={args.vocab}; {args.pairs} pairs x {args.seq} tokens "
          f"({2 * args.pairs * args.seq} tokens a step); torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, r in times.items():
        print(f"  {name:14s} median {median[name] * 1e3:8.1f} ms   first call {r['first_call_s']:.1f} s   "
              f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}")
    if "trl" in median:
        print(f"TRL / ember compiled: {median['trl'] / median['ember']:.2f}x; TRL / ember eager: "
              f"{median['trl'] / median['ember_eager']:.2f}x")
    print(f"DPO / SFT of the same tokens: {median['ember'] / median['sft']:.2f}x with the reference forward, "
          f"{median['ember_precomp'] / median['sft']:.2f}x with precomputed reference log-probs")


if __name__ == "__main__":
    sys.exit(main())
