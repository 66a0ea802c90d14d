"""The outer training loop: feed batches to a pure step, log, evaluate, report throughput.

Public names: `train_loop`, `evaluate`.

The loop is model- and data-agnostic: it takes a compiled step, a state, and an iterator of
batches. Metrics stay on the device between logs; the only host syncs are at log and eval time.

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
from ember.launch.metrics_log import MetricsWriter

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
        tokens_per_step: tokens in one batch, for the tokens/s figure.
        progress: say how long the first step (the compile) took, then show a tqdm progress bar;
            at a log step, say how many steps so far were skipped as non-finite (`state.skipped_steps`, when
            the state has it).
        compiled: whether `step` compiles on its first call (False: an eager step; the first line says it ran).

    Returns:
        The final state.
    """
    start = int(state.step)  # host sync: once, before the loop
    bar = None
    last_time, last_step = time.perf_counter(), start
    metrics: Mapping[str, Any] = {}
    # Non-finite steps skipped by this loop: state.skipped_steps minus its value now (a resumed run's are not news).
    skipped_before = int(state.skipped_steps) if progress and hasattr(state, "skipped_steps") else None
    skipped_told = 0
    for i in range(start + 1, steps + 1):
        try:
            batch = next(batches)
        except StopIteration:
            raise ValueError(
                f"the batch iterator ran out before step {i} of {steps}; make the data repeat over "
                f"epochs or lower `steps`."
            ) from None
        if progress and i == start + 1:
            first_started = time.perf_counter()
            first = "compiling the step..." if compiled else "eager (not compiled)..."
            print(f"step {i}: {first}", end=" ", flush=True)
        state, metrics = step(state, batch)
        stop = should_stop is not None and should_stop()
        logged = False
        if i % log_every == 0 or i == steps or stop:
            row = writer.write(i, metrics)
            logged = True
            now = time.perf_counter()
            tok_s = tokens_per_step * (i - last_step) / max(now - last_time, 1e-9)
            last_time, last_step = now, i
            if bar is not None:
                bar.set_postfix(loss=f"{row.get('loss', float('nan')):.4f}", tok_s=f"{tok_s:,.0f}")
        if eval_fn is not None and not stop and ((eval_every and i % eval_every == 0) or i == steps):
            writer.write(i, eval_fn(state), prefix="eval_")
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
        if stop:
            break
    if bar is not None:
        bar.close()
    return state
