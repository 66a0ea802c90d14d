"""Score a model on lm-eval-harness tasks: a run directory, an exported `--hf` folder or any Hugging Face folder.

    python launch/eval.py runs/a --tasks hellaswag,arc_easy --limit 100     # a run's latest step
    python launch/eval.py runs/a/hf --tasks my_task --include_path my_tasks/ --output_path runs/a/lm_eval
    python launch/eval.py runs/a --tasks my_task --include_path my_tasks/ --nproc-per-node 2 --mesh fsdp=2

Prints lm-eval's table and writes its results JSON (`OUTPUT_PATH/<model>/results_<date>.json`, with
`--log_samples` every request's responses beside it). Datasets are read offline unless
HF_DATASETS_OFFLINE=0 is set: a task whose data is not on this machine is refused before the model is
read. Under `--nproc-per-node N --mesh ...` every rank scores the same requests on the sharded
params (DTensor); rank 0 prints and writes. `--backend xla --mesh fsdp=4` is one process over every XLA
device (torch_xla SPMD). Needs `pip install "ember[eval]"`.
"""

import argparse
import os
import sys

from ember.launch import build, cli, ranks, sharded
from ember.launch.lm_eval_load import xla_sharding


def _parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a run directory (--out of launch/train.py), an exported --hf folder, a HF folder")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    p.add_argument("--include_path", default=None, help="a folder of local lm-eval task YAML files")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction when < 1)")
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--batch_size", type=int, default=8, help="rows per forward (every forward has this many)")
    p.add_argument("--max_length", type=int, default=None, help="longest window (default: the model's max_seq_len)")
    p.add_argument("--output_path", default=None, help="where lm-eval's results JSON goes (default: not written)")
    p.add_argument("--log_samples", action="store_true", help="also write every request's responses")
    p.add_argument("--backend", choices=("inductor", "eager", "xla"), default="inductor",
                   help="how the forward runs: compiled by Inductor, eagerly, or on torch_xla")
    p.add_argument("--mesh", default=None, help="a DTensor mesh over the ranks, e.g. fsdp=2")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None, metavar="N",
                   help="start N processes here (one per device) as torchrun would")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.nproc_per_node is not None and "WORLD_SIZE" not in os.environ:
        ranks.check_nproc(args.nproc_per_node)
        return ranks.run_ranks(args.nproc_per_node, [sys.executable, os.path.abspath(__file__), *argv])
    from ember.launch.lm_eval_tasks import split_tasks, task_manager

    try:
        from ember.launch.lm_eval_lm import require_lm_eval
    except ImportError as error:  # the module needs lm_eval itself
        raise ValueError(str(error)) from None
    require_lm_eval("launch/eval.py")
    names = split_tasks(args.tasks)
    task_manager(names, args.include_path)  # unknown names refused before the model is read
    build.check_backend(args)  # --backend xla without torch_xla: one line
    sharding = xla_sharding(args.mesh) if args.backend == "xla" and args.mesh else \
        sharded.setup(args.mesh, nproc_per_node=args.nproc_per_node)
    finished = False
    try:
        evaluate(args, names, sharding)
        finished = True
        return 0
    finally:
        sharded.teardown(finished=finished)


def evaluate(args, names, sharding):
    """Load, shard, score; rank 0 prints the table and writes the results (lm-eval returns them there only)."""
    from lm_eval.utils import make_table

    from ember.core import device_for
    from ember.launch.lm_eval_lm import EmberLM
    from ember.launch.lm_eval_load import load_model
    from ember.launch.lm_eval_tasks import run_tasks, write_results

    spmd = sharding is not None and args.backend == "xla"  # params placed from the CPU by the layout
    model, params, tokenizer = load_model(args.path, device="cpu" if spmd else device_for(args.backend))
    if sharding is not None:
        sharded.check_mesh(args.backend, sharding, model, say=print if sharded.is_main() else ranks.quiet)
        params = sharded.shard_state(params, sharding, model)
    lm = EmberLM(model, params, tokenizer, batch_size=args.batch_size, max_length=args.max_length,
                 backend=args.backend, sharding=sharding)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = run_tasks(lm, names, include_path=args.include_path, limit=limit, num_fewshot=args.num_fewshot,
                        log_samples=args.log_samples)
    if results is not None and sharded.is_main():
        print(make_table(results))
        if args.output_path:
            name = os.path.basename(os.path.normpath(args.path))
            print(f"wrote {write_results(results, args.output_path, model_name=name)}")
    return results


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
