"""Train a model with ember's pure step: the default run, any registered config, or your own.

    python launch/train.py                                    # llama3_tiny on the stdlib corpus, into runs/default
    python launch/train.py --config gpt2_tiny --model.n_layers 2 --backend eager --steps 50 --out runs/gpt2
    python launch/train.py --dry-run                          # parameters, axes, memory; no step
    python launch/train.py --out runs/a --checkpoint_every 100 --resume   # continue from the latest checkpoint
    python launch/train.py --out runs/a --checkpoint_every 100 --resume_step 200   # from an earlier one
    python launch/train.py --nproc-per-node 4 --mesh fsdp=2,tp=2 --out runs/tp   # 4 ranks, DTensor: ember.launch.ranks

Every config field is a flag (`--help`, `--list-configs`); the pieces are importable from `ember.launch`.
`--resume` of a run that already reached `--steps` says so and changes nothing (exit 0).
Ctrl-C (or SIGTERM) ends the run after the current step with a final checkpoint; a second Ctrl-C quits at once.
`--nproc-per-node N` checks the run, then starts its N ranks itself and exits as one process would (130 after
Ctrl-C, 2 after a mistake); `torchrun --nproc-per-node N launch/train.py ...` runs the same ranks.
"""

import os
import sys

from ember import data, models
from ember.core import device_for, jit
from ember.core.mesh import Mesh
from ember.core.partition_specs import MESH_ORDER
from ember.launch import build, checkpointing, cli, precision, ranks, sharded
from ember.launch.host_memory import retain_freed_host_memory
from ember.launch.interrupt import GracefulStop
from ember.launch.lm_eval_tasks import check_training_tasks
from ember.launch.loop import train_loop
from ember.launch.metrics_log import MetricsWriter, read_metrics
from ember.launch.profiling import StepProfiler
from ember.launch.throughput import Throughput, step_flops
from ember.models.layers.attention_kernel import attention_kernel_report
from ember.launch.report import report_run, save_config
from ember.launch.run_dir import claim_run_directory
from ember.launch.trackers import check_trackers, open_trackers


def main(argv=None):
    parser = cli.launcher_parser()
    parser.add_argument("--dry-run", action="store_true", help="print parameters, axes and memory; train nothing")
    parser.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None, metavar="N",
                        help="check the run, then start N processes here (one per device) as torchrun would")
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parser.parse_known_args(argv)
    retain_freed_host_memory()  # a step frees and re-allocates the same buffers: keep their pages
    cfg = cli.read_config(args, overrides, description=__doc__, parser=parser)
    build.check_backend(cfg)  # before anything is built or written
    check_trackers(cfg.log)  # --log.wandb / --log.mlflow without the package: one line, nothing written
    check_training_tasks(cfg.eval, eval_every=cfg.eval_every)  # --eval.lm_eval_tasks: lm_eval there, names known
    model = build.build_model(cfg)
    if args.dry_run:
        build.preflight(cfg, args, main=False)  # refuses an --init_from of another model
        print(models.describe(model))
        return None
    if args.nproc_per_node is not None and "WORLD_SIZE" not in os.environ:
        return start_ranks(cfg, model, args, argv)
    sharding = sharded.setup(args.mesh, nproc_per_node=args.nproc_per_node,  # None unless under torchrun or --mesh
                             pipeline=sharded.pipeline_schedule(cfg))
    say_once = print if sharded.is_main() and not ranks.checked() else ranks.quiet  # a launcher said it already
    sharded.check_mesh(cfg.backend, sharding, model, say=say_once, seq_len=cfg.data.seq_len)
    precision.check_cuda_graph(cfg, sharding)
    finished, history = False, None
    try:  # only rank 0 writes files: it holds the run directory
        if build.preflight(cfg, args, main=sharded.is_main()):  # else the run already reached --steps
            with sharded.entered_on_every_rank(claim_run_directory(cfg.out if sharded.is_main() else None,
                                                                   resume=args.resume, overwrite=args.overwrite)):
                history = train(cfg, model, sharding, args)
        finished = True
        return history
    finally:
        sharded.teardown(finished=finished)


def start_ranks(cfg, model, args, argv):
    """`--nproc-per-node N`: check the run here first (a mistake is one `error:` line, exit 2, before any rank
    starts), then run this script as N ranks and return the run's exit code (`ember.launch.ranks`)."""
    mesh = Mesh.parse(args.mesh or "dp=-1", devices=ranks.check_nproc(args.nproc_per_node), backend="dtensor")
    sharded.check_mesh(cfg.backend, mesh.in_order(MESH_ORDER), model, say=print, seq_len=cfg.data.seq_len)
    if not build.preflight(cfg, args, main=True):
        return 0  # the run already reached --steps: said so, nothing to start
    with claim_run_directory(cfg.out, resume=args.resume or args.overwrite):
        pass  # free to use (rank 0 claims it, and --overwrite replaces the run there)
    return ranks.run_ranks(args.nproc_per_node, [sys.executable, os.path.abspath(__file__), *argv])


def train(cfg, model, sharding, args):
    main_rank = sharded.is_main()  # only rank 0 writes files and prints
    tokenizer, device = build.build_tokenizer(cfg, model), device_for(cfg.backend)
    precision.set_matmul_precision(cfg.tf32, device)  # TF32 for float32 matmuls on CUDA (--tf32)
    if main_rank:
        print(precision.precision_line(cfg, device))
    state = build.initial_state(cfg, model, device)
    reference = build.precomputed_reference(cfg, model, state.params, tokenizer, device)  # before sharding, donation
    state = sharded.shard_state(state, sharding, model)
    if main_rank and cfg.backend != "xla":  # the SDPA kernel the step's attention runs on this device and dtype
        print(attention_kernel_report(model, state.params, seq_len=cfg.data.seq_len, device=device,
                                      dtype=build.compute_dtype(cfg)))
    compiled = {"deterministic": cfg.deterministic} if cfg.backend == "inductor" else {}
    step = sharded.sharded(jit(build.step_fn(cfg, model), backend=cfg.backend, donate="state",
                               cuda_graph=cfg.cuda_graph, **compiled), sharding, returns_state=True)
    eval_one = sharded.sharded(jit(build.eval_fn(cfg, model), backend=cfg.backend, **compiled), sharding,
                               returns_state=False)
    cp = sharded.context_parallel(sharding)  # > 1: every sequence in its balanced order (ember.data.ContextOrder)
    eval_fn = build.evaluator(cfg, eval_one, tokenizer=tokenizer, device=device, context_parallel=cp,
                              reference_logps=reference, model=model, sharding=sharding) \
        if cfg.eval_every else None  # --eval_every 0: no evaluation, no eval split built
    if args.resume_step is not None:  # the later steps move aside, so this run can save them again
        checkpointing.set_aside_steps_after(cfg, args.resume_step, main=main_rank)
    ckpt, info = checkpointing.build_manager(cfg), checkpointing.model_info_for(cfg, arch=args.config)
    batches = data.build_batches(cfg.data, tokenizer=tokenizer, device=device, context_parallel=cp,
                                 reference_logps=reference)
    if main_rank and (note := data.corpus_note(cfg.data)):
        print(note)
    state = checkpointing.maybe_resume(ckpt, state, batches, cfg=cfg, resume=args.resume, step=args.resume_step,
                                       model_info=info, sharding=sharding, axes=model.axes,
                                       log=print if main_rank else (lambda _: None))
    resumed = int(state.step) > 0  # then metrics.jsonl keeps its rows up to the restored step
    cfg.profile.check(steps=cfg.steps, start=int(state.step))  # --profile.steps before the resumed step: refused
    # The loss before any step, for reference; keep_best must name one of its metrics (checked before any file).
    first_eval = None if resumed or eval_fn is None else checkpointing.check_keep_best(cfg, eval_fn(state))
    writer = MetricsWriter(cfg.out if main_rank else None, append=resumed, up_to_step=int(state.step) if resumed else None,
                           trackers=open_trackers(cfg, cfg.out if main_rank else None, resumed=resumed))
    hooks = dict(cfg=cfg, writer=writer, model_info=info, sharding=sharding)
    sides = 2 if build.preference_run(cfg) else 1  # a preference batch holds a chosen and a rejected row per pair
    stop = GracefulStop()  # entered last: jax.distributed (multi-process checkpoints) installs its own SIGTERM handler
    tokens = cfg.data.batch_size * cfg.data.seq_len * sides
    throughput = Throughput(tokens_per_step=tokens, device=device, flops=step_flops(cfg) if main_rank else None,
                            n_devices=int(os.environ.get("WORLD_SIZE", "1")), dtype=build.compute_dtype(cfg),
                            tf32=cfg.tf32)  # MFU from the step's own FLOPs (ember.launch.throughput)
    profiler = StepProfiler(cfg.profile, cfg.out or ".", device=device) if main_rank and cfg.profile.steps else None
    try:
        if main_rank:
            save_config(cfg)
        if first_eval is not None:
            writer.write(0, first_eval, prefix="eval_")
        with stop:
            state = train_loop(step, state, batches, steps=cfg.steps, writer=writer, log_every=cfg.log_every,
                               eval_every=cfg.eval_every, eval_fn=eval_fn, progress=main_rank,
                               compiled=cfg.backend != "eager",
                               tokens_per_step=tokens, throughput=throughput, profiler=profiler,
                               on_step_end=checkpointing.checkpoint_hook(ckpt, batches, **hooks),
                               should_stop=sharded.on_every_rank(stop.requested))
        saved = checkpointing.finish(ckpt, state, batches, **hooks)
        params = sharded.gathered(state.params, sharding)  # whole tensors on every rank, for sampling
    finally:
        writer.close()
        if ckpt is not None:
            ckpt.close()
    if main_rank:  # a resumed run reports the whole run's log
        report_run(cfg, read_metrics(cfg.out) if resumed else writer.history, model=model, params=params,
                   tokenizer=tokenizer, device=device, sample=not stop.requested())
    stop.raise_if_stopped(step=int(state.step), steps=cfg.steps, checkpoint_dir=ckpt and ckpt.directory, saved_step=saved)
    return writer.history


if __name__ == "__main__":
    sys.exit(cli.run_main(main))
