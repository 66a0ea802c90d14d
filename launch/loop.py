"""The outer training loop: feed batches to a pure step, log, evaluate, report throughput.

Public names: `train_loop`, `evaluate`.

The loop is model- and data-agnostic: it takes a compiled step, a state, and an iterator of
batches. Metrics stay on the device between logs; the only host syncs are at log and eval time.
Every logged row also carries the throughput, time and memory keys of `ember.launch.throughput`
(`throughput/tokens_per_s`, `throughput/mfu`, `time/step_s`, `time/data_wait_s`, `time/compute_s`,
`memory/peak_gib`), timed from one log's host sync to the next; `--profile.steps` traces chosen steps
(`ember.launch.profiling.StepProfiler`).

Example:
    >>> import torch
    >>> from ember.core import TrainState
    >>> from ember.launch.metrics_log import MetricsWriter
    >>> class Halve:  # a minimal gradient transformation
    ...     init = staticmethod(lambda p: {})
    ...     update = staticmethod(lambda g, s, p=None: ({k: -0.5 * v for k, v in g.items()}, s))
    >>> def step(state, batch):
    ...     grads = {"w": state.params["w"] - batch}
    ...     return state.apply_gradients(grads=grads), {"loss": (state.params["w"] - batch).pow(2).sum()}
    >>> state = TrainState.create(params={"w": torch.zeros(())}, tx=Halve())
    >>> writer = MetricsWriter(None)
    >>> state = train_loop(step, state, iter([torch.tensor(1.0)] * 4), steps=4, writer=writer,
    ...                    log_every=2, progress=False)
    >>> [r["step"] for r in writer.history], round(float(state.params["w"]), 4)
    ([2, 4], 0.9375)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from ember.core.types import Batch, Metrics, PyTree
from ember.launch.metrics_log import MetricsWriter, host_values
from ember.launch.profiling import StepProfiler
from ember.launch.throughput import Throughput

__all__ = ["evaluate", "train_loop"]

Step = Callable[[PyTree, Batch], "tuple[PyTree, Metrics]"]


def evaluate(eval_fn: Callable[[PyTree, Batch], Metrics], params: PyTree, batches: Iterable[Batch]) -> Metrics:
    """Mean of `eval_fn(params, batch)` metrics over `batches` (0-d tensors, still on device).

    When the metrics have `tokens` (a `TokenLoss` objective), `loss` is weighted by them and
    `tokens` is their sum; every other metric is the plain mean over batches.
    """
    totals: dict = {}
    n = 0
    for batch in batches:
        metrics = {k: v.float() for k, v in eval_fn(params, batch).items()}
        if "tokens" in metrics:
            metrics["loss"] = metrics["loss"] * metrics["tokens"]
        for k, v in metrics.items():
            totals[k] = totals[k] + v if k in totals else v
        n += 1
    if n == 0:
        raise ValueError("evaluate() got no batches: the eval split is empty or eval_batches is 0.")
    means = {k: v / n for k, v in totals.items()}
    if "tokens" in totals:
        means["loss"] = totals["loss"] / totals["tokens"].clamp(min=1.0)
        means["tokens"] = totals["tokens"]
    return means


def _progress_bar(*, total: int, initial: int) -> Any:
    from tqdm.auto import tqdm  # imported here: only an interactive run needs it

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def _notice(bar: Any, text: str) -> None:
    if bar is not None:
        bar.write(text)  # above the progress bar, which redraws under it
    else:
        print(text, flush=True)


def train_loop(
    step: Step,
    state: PyTree,
    batches: Iterator[Batch],
    *,
    steps: int,
    writer: MetricsWriter,
    log_every: int = 10,
    eval_every: int = 0,
    eval_fn: Optional[Callable[[PyTree], Metrics]] = None,
    on_step_end: Optional[Callable[[int, PyTree], None]] = None,
    should_stop: Optional[Callable[[], bool]] = None,
    tokens_per_step: int = 0,
    progress: bool = True,
    compiled: bool = True,
    throughput: Optional[Throughput] = None,
    profiler: Optional[StepProfiler] = None,
) -> PyTree:
    """Run `step` until `state.step == steps`, logging every `log_every` steps.

    Args:
        step: the (compiled) pure step `(state, batch) -> (state, metrics)`.
        state: the starting state; a resumed state starts from its own `step`.
        batches: an iterator of batches, already positioned for `state.step`.
        steps: the total number of steps of the run (not the number still to do).
        writer: where metrics go (`MetricsWriter`).
        log_every: steps between logs; the last step is always logged.
        eval_every: steps between calls of `eval_fn(state)` (0: only at the end, if given).
        eval_fn: `state -> metrics`, logged with the prefix `eval_`.
        on_step_end: called as `on_step_end(step_number, state)` after every step (checkpoints).
        should_stop: polled after every step; True ends the loop there (the step is logged; no
            eval). `GracefulStop.requested` turns Ctrl-C into this.
        tokens_per_step: tokens in one batch, for the tokens/s figure (a `throughput` given has its own).
        progress: say how long the first step (the compile) took, then show a tqdm progress bar;
            at a log step, say how many steps so far were skipped as non-finite (`state.skipped_steps`, when
            the state has it).
        compiled: whether `step` compiles on its first call (False: an eager step; the first line says it ran).
        throughput: adds the throughput, time and memory keys to each logged row, and counts the step's
            FLOPs (for MFU) on the first batch (`ember.launch.throughput.Throughput`); None: one with
            `tokens_per_step` on the CPU, without MFU. The time keys cover the steps after the first
            (its compile): a row logged at the first step has only `memory/peak_gib`. Evaluation and
            writing a profile are left out of them.
        profiler: traces its steps (`ember.launch.profiling.StepProfiler`); only observes the step.

    Returns:
        The final state.
    """
    start = int(state.step)  # host sync: once, before the loop
    throughput = Throughput(tokens_per_step=tokens_per_step) if throughput is None else throughput
    bar = None
    last_time, last_step, data_wait = 0.0, start + 1, 0.0  # the clock starts after the first step (its compile)
    metrics: Mapping[str, Any] = {}
    # Non-finite steps skipped by this loop: state.skipped_steps minus its value now (a resumed run's are not news).
    skipped_before = int(state.skipped_steps) if progress and hasattr(state, "skipped_steps") else None
    skipped_told = 0
    try:
        for i in range(start + 1, steps + 1):
            if profiler is not None:
                profiler.step_started(i)
            waited = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                raise ValueError(
                    f"the batch iterator ran out before step {i} of {steps}; make the data repeat over "
                    f"epochs or lower `steps`."
                ) from None
            data_wait += time.perf_counter() - waited
            if i == start + 1:
                throughput.start(state, batch)  # FLOPs of one step, on fake tensors: before the state is donated
                if progress and throughput.flops_per_step:
                    print(f"throughput: {throughput.flops_per_step / 1e9:,.3g} GFLOP per step (FlopCounterMode), peak "
                          f"{throughput.peak / 1e12:,.3g} TFLOP/s per device ({throughput.peak_source}) for MFU",
                          flush=True)
            if progress and i == start + 1:
                first_started = time.perf_counter()
                first = "compiling the step..." if compiled else "eager (not compiled)..."
                print(f"step {i}: {first}", end=" ", flush=True)
            state, metrics = step(state, batch)
            if i == start + 1:
                last_time, data_wait = time.perf_counter(), 0.0
            stop = should_stop is not None and should_stop()
            logged = False
            if i % log_every == 0 or i == steps or stop:
                values = host_values(metrics)  # host sync: the one per logged step (the writer gets numbers)
                now = time.perf_counter()
                timing = throughput.row(steps=i - last_step, seconds=now - last_time, data_wait=data_wait)
                row = writer.write(i, {**values, **timing})
                logged = True
                last_time, last_step, data_wait = now, i, 0.0
                if bar is not None:
                    shown = {"loss": f"{row.get('loss', float('nan')):.4f}"}
                    if "throughput/tokens_per_s" in row:
                        shown["tok_s"] = f"{row['throughput/tokens_per_s']:,.0f}"
                    if "throughput/mfu" in row:
                        shown["mfu"] = f"{row['throughput/mfu']:.1%}"
                    bar.set_postfix(**shown)
            if eval_fn is not None and not stop and ((eval_every and i % eval_every == 0) or i == steps):
                evaluated = time.perf_counter()
                writer.write(i, eval_fn(state), prefix="eval_")
                last_time += time.perf_counter() - evaluated  # evaluation is not the steps' time
            if on_step_end is not None:
                on_step_end(i, state)
            if progress and bar is None:  # after the first step: its time was the compile, not the ETA's
                ran = "compiled and ran" if compiled else "ran"
                print(f"{ran} in {time.perf_counter() - first_started:.1f}s", flush=True)
                bar = _progress_bar(total=steps, initial=i)
            elif bar is not None:
                bar.update(1)
            skipped = int(state.skipped_steps) - skipped_before if logged and skipped_before is not None else 0  # host sync
            if skipped > skipped_told:
                skipped_told = skipped
                _notice(bar, f"step {i}: skipped {skipped_told} non-finite step{'s' * (skipped_told > 1)} so far "
                             f"(NaN/inf loss or gradients: no update applied); lower --optim.learning_rate if it goes on")
            if profiler is not None:
                saving = time.perf_counter()
                profiler.step_done(i)
                last_time += time.perf_counter() - saving  # writing the trace is not the steps' time
            if stop:
                break
    finally:
        if profiler is not None:
            profiler.close()
    if bar is not None:
        bar.close()
    return state
