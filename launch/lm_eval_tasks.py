"""Standard evaluations through lm-eval-harness: its tasks, run on an ember model.

Public names: `EvalConfig`, `run_tasks`, `flatten_scores`, `write_results`, `task_manager`, `offline`,
`check_training_tasks`, `training_scorer`.

    results = run_tasks(EmberLM.from_path("runs/a/hf"), ["hellaswag"], limit=100)
    flatten_scores(results)     # {"lm_eval/hellaswag/acc": 0.31, "lm_eval/hellaswag/acc_norm": 0.33, ...}
    write_results(results, "runs/a/lm_eval")   # lm-eval's own results_<date>.json

Tasks run offline unless asked (`offline=False`, or HF_DATASETS_OFFLINE=0 in the environment): a task whose
data is neither local (`dataset_path: json` with local `data_files`, a local folder) nor in the datasets
cache is refused before the model runs, as is a task name lm-eval does not know (the nearest names given).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["EvalConfig", "check_training_tasks", "flatten_scores", "offline", "run_tasks", "task_manager",
           "training_scorer", "write_results"]


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """lm-eval tasks run during training (`--eval.lm_eval_tasks hellaswag,arc_easy`), every `eval_every` steps."""

    lm_eval_tasks: str = ""
    """Comma-separated lm-eval task names; "": none. Needs `pip install "ember[eval]"`."""
    lm_eval_include_path: Optional[str] = None
    """A folder of local lm-eval task YAML files (lm-eval's --include_path)."""
    lm_eval_limit: Optional[int] = None
    """Documents per task (lm-eval's --limit); None: all."""

    def task_names(self) -> List[str]:
        """`lm_eval_tasks` as a list (empty: no tasks)."""
        return split_tasks(self.lm_eval_tasks)


def split_tasks(text: str) -> List[str]:
    """"a, b" -> ["a", "b"]."""
    return [t.strip() for t in (text or "").split(",") if t.strip()]


_OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def _user_allows_network() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("0", "false", "no") for v in _OFFLINE_VARS)


@contextlib.contextmanager
def offline(enabled: Optional[bool] = None) -> Iterator[bool]:
    """Within: datasets and the hub offline (`enabled`; None: unless HF_DATASETS_OFFLINE=0 / HF_HUB_OFFLINE=0)."""
    enabled = not _user_allows_network() if enabled is None else enabled
    saved = {v: os.environ.get(v) for v in _OFFLINE_VARS}
    patched: List[Any] = []
    if enabled:
        os.environ.update({v: "1" for v in _OFFLINE_VARS})
        for module, name in (("datasets.config", "HF_DATASETS_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                             ("huggingface_hub.constants", "HF_HUB_OFFLINE")):
            try:  # both read the variables once, at import
                mod = __import__(module, fromlist=[name])
            except ImportError:
                continue
            if hasattr(mod, name):
                patched.append((mod, name, getattr(mod, name)))
                setattr(mod, name, True)
    try:
        yield enabled
    finally:
        for mod, name, value in patched:
            setattr(mod, name, value)
        for v, value in saved.items():
            if value is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = value


def task_manager(names: Sequence[str], include_path: Optional[str] = None) -> Any:
    """lm-eval's `TaskManager` that knows every name in `names` (only the `include_path` tasks when those suffice;
    made once per process for the same arguments).

    Raises:
        ValueError: no task names, a missing include_path, or a name lm-eval does not know (nearest names given).
    """
    return _task_manager(tuple(names), include_path)


@functools.lru_cache(maxsize=4)  # indexing lm-eval's own tasks takes seconds: a run's checks and evaluations share it
def _task_manager(names: Tuple[str, ...], include_path: Optional[str]) -> Any:
    from ember.launch.lm_eval_lm import require_lm_eval

    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if not names:
        raise ValueError("no lm-eval task given; pass task names, e.g. --tasks hellaswag,arc_easy.")
    if include_path is not None and not os.path.isdir(include_path):
        raise ValueError(f"--include_path {include_path}: no such folder; pass a folder of lm-eval task YAML files.")
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local  # indexing lm-eval's own thousands of tasks takes seconds
    manager = TaskManager(include_path=include_path)
    unknown = [n for n in names if n not in manager.all_tasks and not manager.match_tasks([n])]
    if unknown:
        name = unknown[0]
        near = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
        hint = f"nearest: {', '.join(near)}" if near else "`lm_eval ls tasks` lists them"
        where = f" or in --include_path {include_path}" if include_path else ""
        raise ValueError(f"lm-eval task {name!r} is not one of lm-eval's {len(manager.all_tasks)} tasks{where} "
                         f"({hint}); pass a known task name, or a folder of task YAML files with --include_path.")
    return manager


def _needs_network(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}".lower()
    return any(k in text for k in ("offline", "connection", "couldn't reach", "hub", "datasetnotfound",
                                   "doesn't exist on the hub", "cannot find the requested files"))


def load_tasks(names: Sequence[str], manager: Any, *, allow_network: bool) -> Any:
    """Build the tasks (their data read) before any model runs; a task whose data needs the network, refused.

    Raises:
        ValueError: offline, a task whose dataset is neither local nor in the datasets cache.
    """
    try:
        return manager.load(list(names))
    except Exception as error:  # datasets / hub raise many types for "not here"
        if allow_network or not _needs_network(error):
            raise
        raise ValueError(f"lm-eval tasks {', '.join(names)}: a dataset is not on this machine and evaluations run "
                         f"offline ({type(error).__name__}: {str(error).splitlines()[0][:160]}); pass a local task "
                         f"(--include_path DIR with `dataset_path: json` and local data_files), or allow downloads "
                         f"with HF_DATASETS_OFFLINE=0.") from None


def run_tasks(lm: Any, tasks: Sequence[str], *, include_path: Optional[str] = None, limit: Optional[float] = None,
              num_fewshot: Optional[int] = None, allow_network: Optional[bool] = None, log_samples: bool = False,
              bootstrap_iters: int = 0, manager: Any = None, **kwargs: Any) -> Dict[str, Any]:
    """lm-eval's `simple_evaluate` of `tasks` on `lm` (an `EmberLM`): its results dict.

    Args:
        lm: an lm-eval `LM`.
        tasks: task (or group) names.
        include_path: a folder of local task YAML files.
        limit: documents per task (lm-eval's --limit).
        num_fewshot: few-shot examples (None: each task's default).
        allow_network: download datasets; None: only with HF_DATASETS_OFFLINE=0 / HF_HUB_OFFLINE=0 set.
        log_samples: keep every request's responses (`results["samples"]`).
        bootstrap_iters: lm-eval's stderr bootstrap (0: none, fast).
        manager: a `task_manager(tasks, include_path)` made before (default: made here).
        kwargs: more `simple_evaluate` arguments.

    Raises:
        ValueError: an unknown task name, or a task needing the network while offline.
    """
    from lm_eval import simple_evaluate

    names = list(tasks)
    manager = manager or task_manager(names, include_path)
    with offline(None if allow_network is None else not allow_network) as is_offline:
        load_tasks(names, manager, allow_network=not is_offline)
        return simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                               log_samples=log_samples, bootstrap_iters=bootstrap_iters, **kwargs)


def flatten_scores(results: Dict[str, Any], prefix: str = "lm_eval") -> Dict[str, float]:
    """`{"<prefix>/<task>/<metric>": value}` of every numeric score, stderrs left out (a filter other than
    "none": `<metric>/<filter>`)."""
    out = {}
    for task, scores in (results.get("results") or {}).items():
        for key, value in scores.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or isinstance(value, (str, bool)) or value is None:
                continue
            try:
                out[f"{prefix}/{task}/{metric if filt == 'none' else f'{metric}/{filt}'}"] = float(value)
            except (TypeError, ValueError):
                continue
    return out


def write_results(results: Dict[str, Any], output_path: str, *, model_name: str = "ember") -> str:
    """Write `results` as lm-eval does (`EvaluationTracker`: `output_path/<model_name>/results_<date>.json`, and
    `samples_<task>_<date>.jsonl` beside it when `results` holds samples); returns the results file."""
    from lm_eval.loggers import EvaluationTracker

    os.makedirs(output_path, exist_ok=True)
    tracker = EvaluationTracker(output_path=output_path)
    tracker.general_config_tracker.model_name = model_name
    tracker.general_config_tracker.model_name_sanitized = model_name.replace("/", "__").replace(":", "_")
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples:
        for task in results.get("configs", {}):
            if task in samples:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    found = sorted((os.path.join(d, f) for d, _, fs in os.walk(output_path) for f in fs
                    if f.startswith("results_") and f.endswith(".json")), key=os.path.getmtime)
    return found[-1]


def check_training_tasks(config: EvalConfig, *, eval_every: int) -> None:
    """Refuse `--eval.lm_eval_tasks` that would never run or cannot: before anything is built or written.

    Raises:
        ValueError: `eval_every` 0, lm_eval missing (naming `pip install "ember[eval]"`), or an unknown task.
    """
    names = config.task_names()
    if not names:
        return
    if not eval_every:
        raise ValueError(f"--eval.lm_eval_tasks {config.lm_eval_tasks} scores tasks at each evaluation, but "
                         f"eval_every=0 runs none; pass --eval_every N, or drop --eval.lm_eval_tasks.")
    try:
        from ember.launch.lm_eval_lm import require_lm_eval
    except ImportError as error:
        raise ValueError(f"--eval.lm_eval_tasks: {error}") from None
    require_lm_eval()
    task_manager(names, config.lm_eval_include_path)


def training_scorer(config: EvalConfig, model: Any, tokenizer: Any, *, backend: str, batch_size: int,
                    sharding: Any = None) -> Callable[[Any], Dict[str, float]]:
    """`score(params) -> {"lm_eval/<task>/<metric>": value}`: `config`'s tasks on the live params, at every
    evaluation (one `EmberLM`, so its compiled forward is reused). Task names are checked here, before training.

    Raises:
        ValueError: lm_eval missing (naming `pip install "ember[eval]"`), or an unknown task.
    """
    import torch.distributed as dist

    try:
        from ember.launch.lm_eval_lm import EmberLM
    except ImportError as error:
        raise ValueError(f"--eval.lm_eval_tasks: {error}") from None
    names = config.task_names()
    manager = task_manager(names, config.lm_eval_include_path)
    lm = EmberLM(model, None, tokenizer, batch_size=batch_size, backend=backend, sharding=sharding)

    def score(params: Any) -> Dict[str, float]:
        lm.params = params
        results = run_tasks(lm, names, include_path=config.lm_eval_include_path, limit=config.lm_eval_limit,
                            manager=manager)
        scores = flatten_scores(results) if results is not None else {}  # lm-eval returns them on rank 0 only
        if sharding is not None and dist.is_initialized() and dist.get_world_size() > 1:
            shared = [scores]
            dist.broadcast_object_list(shared, src=0)  # every rank logs (and ranks checkpoints by) the same scores
            scores = shared[0]
        return scores

    return score
