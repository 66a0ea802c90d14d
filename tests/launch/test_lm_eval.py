"""lm-eval-harness on ember models: `EmberLM` against lm-eval's own `HFLM`, `launch/eval.py`, in-training scores.

Everything is local: a tiny random Qwen2 folder and three task YAMLs over JSONL files
(tests/launch/_lm_eval_fixtures.py).
"""

import json
import os
import pathlib
import sys

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lm_eval_fixtures import TASKS, write_model, write_tasks  # noqa: E402

from ember.launch import cli  # noqa: E402
from ember.launch.lm_eval_lm import EmberLM, require_lm_eval  # noqa: E402
from ember.launch.lm_eval_tasks import flatten_scores, run_tasks  # noqa: E402

pytestmark = pytest.mark.xdist_group("lm_eval")  # one worker runs the module: the model, tasks and HFLM's results once

LOGP_ATOL = 1e-4  # float32 forwards of two implementations (SDPA vs transformers' attention)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    return write_model(root), write_tasks(root)


@pytest.fixture(scope="module")
def reference(local):
    """lm-eval's HFLM on the folder: results with every request's responses."""
    from lm_eval.models.huggingface import HFLM

    folder, tasks = local
    hf = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=4)
    return run_tasks(hf, TASKS, include_path=tasks, log_samples=True)


@pytest.fixture(scope="module")
def ours(local):
    folder, tasks = local
    return run_tasks(EmberLM.from_path(folder, backend="eager", batch_size=4), TASKS, include_path=tasks,
                     log_samples=True)


def _resps(results, task):
    return [s["resps"] for s in results["samples"][task]]


@pytest.mark.parametrize("task", ["ember_mc", "ember_ppl"])
def test_log_likelihoods_match_hflm(ours, reference, task):
    """Per request: multiple choice gives (log p, greedy) per choice, rolling one summed log p per document."""
    for mine, theirs in zip(_resps(ours, task), _resps(reference, task), strict=True):
        for (a,), (b,) in zip(mine, theirs, strict=True):
            if task == "ember_mc":
                assert abs(a[0] - b[0]) <= LOGP_ATOL and a[1] == b[1], (a, b)
            else:  # a sum over up to a few hundred tokens: the same tolerance per 100 tokens' worth of log p
                assert abs(a - b) <= LOGP_ATOL * max(1.0, abs(b) / 100), (a, b)


def test_greedy_generations_match_hflm(ours, reference):
    mine, theirs = _resps(ours, "ember_gen"), _resps(reference, "ember_gen")
    assert mine == theirs
    assert any(r[0][0] for r in mine)  # not all empty: the stop string cut them at different places


def test_task_scores_match_hflm(ours, reference):
    a, b = flatten_scores(ours), flatten_scores(reference)
    assert a.keys() == b.keys() and {"lm_eval/ember_mc/acc", "lm_eval/ember_ppl/word_perplexity",
                                     "lm_eval/ember_gen/exact_match"} <= a.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-4), k


def test_forwards_come_in_a_handful_of_shapes(local):
    """Rows sorted, padded to power-of-two lengths and a fixed batch: the compiled forward sees few shapes."""
    folder, tasks = local
    lm = EmberLM.from_path(folder, backend="eager", batch_size=4)
    shapes, forward = [], lm._forward
    lm._forward = lambda params, batch: shapes.append(tuple(batch["tokens"].shape)) or forward(params, batch)
    run_tasks(lm, ["ember_mc", "ember_ppl"], include_path=tasks)
    assert len(shapes) >= 6 and set(shapes) <= {(4, 16), (4, 32), (4, 256)}, shapes


def test_a_lora_model_scores_and_generates_as_its_merged_weights(local):
    """A live LoRA state scores through `LoRAModel.apply` and generates with the adapters merged into the base."""
    import torch

    from ember.core import pytree, random
    from ember.models import from_hf, to_lora
    from ember.data import load_model_tokenizer

    folder, _ = local
    model, params = from_hf(folder)
    lora = to_lora(model, rank=2)
    lp = lora.init_from(params, key=random.key(3))
    lp["lora"] = pytree.tree_map(lambda t: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(4)),
                                 lp["lora"])  # B starts at zero: move it so the adapters matter
    tok = load_model_tokenizer(folder)
    adapted = EmberLM(lora, lp, tok, backend="eager", batch_size=4)
    merged = EmberLM(model, lora.merged(lp), tok, backend="eager", batch_size=4)
    plain = EmberLM(model, params, tok, backend="eager", batch_size=4)
    requests = [(None, adapted.tok_encode("What is 3 plus 3?"), adapted.tok_encode(" 6.")),
                (None, adapted.tok_encode("hello"), adapted.tok_encode(" there, 2 plus 2"))]
    a, m, p = (lm._loglikelihood_tokens(requests) for lm in (adapted, merged, plain))
    assert all(abs(x[0] - y[0]) <= LOGP_ATOL for x, y in zip(a, m)) and a != p
    prompts = [adapted.tok_encode("What is 4 plus 4?")]
    assert adapted._generate(prompts, 8, []) == merged._generate(prompts, 8, [])


def test_eval_script_writes_lm_evals_results_json(local, tmp_path, capsys):
    from ember.launch import eval as eval_script

    folder, tasks = local
    out = tmp_path / "results"
    code = cli.run_main(lambda: eval_script.main([folder, "--tasks", "ember_mc,ember_gen", "--include_path", tasks,
                                                  "--limit", "3", "--batch_size", "4", "--backend", "eager",
                                                  "--output_path", str(out)]))
    assert code == 0, capsys.readouterr().err
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert set(saved["results"]) == {"ember_mc", "ember_gen"} and saved["n-samples"]["ember_mc"]["effective"] == 3
    assert "acc,none" in saved["results"]["ember_mc"]


def _refused(argv, capsys):
    from ember.launch import eval as eval_script

    code = cli.run_main(lambda: eval_script.main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_an_unknown_task_is_refused_with_the_nearest_names(local, capsys):
    folder, tasks = local
    line = _refused([folder, "--tasks", "ember_mcq", "--include_path", tasks, "--backend", "eager"], capsys)
    assert "'ember_mcq'" in line and "nearest: ember_mc" in line and "--include_path" in line


def test_a_task_needing_the_network_is_refused_offline(local, tmp_path, capsys, monkeypatch):
    folder, _ = local
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    (tmp_path / "hub.yaml").write_text("task: ember_hub\ndataset_path: ember-tests/no-such-dataset\ntest_split: test\n"
                                       "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: ['a', 'b']\n"
                                       "doc_to_target: 0\n")
    line = _refused([folder, "--tasks", "ember_hub", "--include_path", str(tmp_path), "--backend", "eager"], capsys)
    assert "not on this machine" in line and "HF_DATASETS_OFFLINE=0" in line and "--include_path" in line


def test_a_missing_folder_is_refused(tmp_path, local, capsys):
    _, tasks = local
    line = _refused([str(tmp_path / "nope"), "--tasks", "ember_mc", "--include_path", tasks], capsys)
    assert "no such folder" in line


def test_a_missing_lm_eval_names_the_extra(local, monkeypatch, capsys):
    folder, tasks = local
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    monkeypatch.delitem(sys.modules, "ember.launch.lm_eval_lm")
    with pytest.raises(ImportError, match=r'pip install "ember\[eval\]"'):
        require_lm_eval("lm-eval tasks")
    line = _refused([folder, "--tasks", "ember_mc", "--include_path", tasks], capsys)
    assert 'pip install "ember[eval]"' in line


@pytest.fixture(scope="module")
def trained_run(local, tmp_path_factory):
    """A 2-step run of the default model (byte tokenizer) scoring two tasks at each evaluation, checkpointed."""
    from ember.launch import train

    _, tasks = local
    out = tmp_path_factory.mktemp("trained") / "run"
    train.main(["--steps", "2", "--eval_every", "2", "--eval_batches", "1", "--backend", "eager", "--out", str(out),
                "--model.n_layers", "1", "--data.batch_size", "2", "--data.seq_len", "32", "--data.max_bytes", "300000",
                "--sample_tokens", "4", "--checkpoint_every", "2", "--eval.lm_eval_tasks", "ember_mc,ember_gen",
                "--eval.lm_eval_include_path", tasks, "--eval.lm_eval_limit", "2"])
    return out


def test_training_logs_lm_eval_scores_at_each_evaluation(trained_run):
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert {"eval_lm_eval/ember_mc/acc", "eval_lm_eval/ember_mc/acc_norm", "eval_lm_eval/ember_gen/exact_match"} \
            <= r.keys(), r


def test_a_run_directory_and_its_hf_export_score_alike(trained_run, local):
    """The run's latest step from its checkpoints (byte tokenizer) and from `ckpt.py export --hf` (tokenizer.json)."""
    from ember.launch import ckpt

    _, tasks = local
    exported = str(trained_run / "hf")
    ckpt.main(["export", str(trained_run), "--hf", "--out", exported])
    results = [run_tasks(EmberLM.from_path(path, backend="eager", batch_size=4), ["ember_mc", "ember_gen"],
                         include_path=tasks, limit=3, log_samples=True) for path in (str(trained_run), exported)]
    for task in ("ember_mc", "ember_gen"):
        run, hf = (_resps(r, task) for r in results)
        assert len(run) == 3
        if task == "ember_gen":
            assert run == hf
        for mine, theirs in zip(run, hf):
            if task == "ember_mc":
                assert _logps(mine) == pytest.approx(_logps(theirs), abs=LOGP_ATOL)
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "eval_loss" in r][-1]
    assert last["eval_lm_eval/ember_mc/acc"] == pytest.approx(flatten_scores(  # limit 2 in training: first 2 docs
        run_tasks(EmberLM.from_path(str(trained_run), backend="eager", batch_size=2), ["ember_mc"], include_path=tasks,
                  limit=2))["lm_eval/ember_mc/acc"])


@pytest.mark.slow
def test_training_on_fsdp2_logs_the_scores_of_one_process(trained_run, local, tmp_path):
    """`train.py --nproc-per-node 2 --mesh fsdp=2 --eval.lm_eval_tasks ...`: every rank scores, rank 0 logs."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _processes import run_in_own_group

    _, tasks = local
    script = pathlib.Path(__file__).resolve().parents[2] / "launch" / "train.py"
    out = tmp_path / "run"
    proc = run_in_own_group([sys.executable, str(script), "--steps", "2", "--eval_every", "2", "--eval_batches", "1",
                             "--backend", "eager", "--out", str(out), "--model.n_layers", "1", "--data.batch_size", "2",
                             "--data.seq_len", "32", "--data.max_bytes", "300000", "--sample_tokens", "4",
                             "--eval.lm_eval_tasks", "ember_mc,ember_gen", "--eval.lm_eval_include_path", tasks,
                             "--eval.lm_eval_limit", "2", "--nproc-per-node", "2", "--mesh", "fsdp=2"],
                            timeout=300, cwd=tmp_path, env=_cpu_ranks_env())
    assert proc.returncode == 0, proc.stderr[-4000:]

    def scores(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k.startswith("eval_lm_eval/")} for r in rows if "eval_loss" in r]

    assert scores(out) == scores(trained_run) and len(scores(out)) == 2


def test_training_refuses_an_unknown_lm_eval_task_before_any_step(local, tmp_path):
    from ember.launch import train

    _, tasks = local
    with pytest.raises(ValueError, match="'ember_mcq'.*nearest: ember_mc"):
        train.main(["--steps", "1", "--backend", "eager", "--out", str(tmp_path / "run"), "--model.n_layers", "1",
                    "--eval.lm_eval_tasks", "ember_mcq", "--eval.lm_eval_include_path", tasks])
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_training_refuses_lm_eval_tasks_without_evaluations(local, tmp_path):
    from ember.launch import train

    _, tasks = local
    with pytest.raises(ValueError, match="eval_every=0 runs none; pass --eval_every N"):
        train.main(["--steps", "1", "--eval_every", "0", "--out", str(tmp_path / "run"),
                    "--eval.lm_eval_tasks", "ember_mc", "--eval.lm_eval_include_path", tasks])


def _samples(folder: pathlib.Path) -> dict:
    """`{task: [resps per doc]}` from the samples_<task>_<date>.jsonl files lm-eval wrote under `folder`."""
    out = {}
    for path in folder.rglob("samples_*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out[path.name.split("_20")[0][len("samples_"):]] = [r["resps"] for r in sorted(rows, key=lambda r: r["doc_id"])]
    return out


def _logps(resps) -> list:
    """The log-likelihoods of one document's responses (lm-eval's samples file writes them as strings)."""
    return [float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0]) for r in resps]


@pytest.mark.slow
def test_fsdp2_over_gloo_scores_as_one_device(local, ours, tmp_path):
    """`launch/eval.py --nproc-per-node 2 --mesh fsdp=2`: both ranks run every request on the split params."""
    samples = _eval_script_samples(local, tmp_path, ["--backend", "eager", "--nproc-per-node", "2", "--mesh", "fsdp=2"])
    _assert_same_responses(samples, ours)


def _eval_script_samples(local, tmp_path, extra, env=None):
    """Run `launch/eval.py` on the folder in a process group of its own; `{task: resps}` from its samples files."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _processes import run_in_own_group

    folder, tasks = local
    script = pathlib.Path(__file__).resolve().parents[2] / "launch" / "eval.py"
    proc = run_in_own_group([sys.executable, str(script), folder, "--tasks", ",".join(TASKS), "--include_path", tasks,
                             "--batch_size", "4", "--output_path", str(tmp_path), "--log_samples", *extra],
                            timeout=300, cwd=tmp_path, env=_cpu_ranks_env(env))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _samples(tmp_path)


def _cpu_ranks_env(env=None):
    """The ranks run over gloo on the CPU: on a GPU host each would otherwise take GPU 0."""
    return dict(os.environ if env is None else env, CUDA_VISIBLE_DEVICES="")


def _assert_same_responses(samples, ours):
    assert samples.keys() == set(TASKS)
    assert samples["ember_gen"] == _resps(ours, "ember_gen")
    for task in ("ember_mc", "ember_ppl"):
        for mine, theirs in zip(samples[task], _resps(ours, task), strict=True):
            for a, b in zip(_logps(mine), _logps(theirs), strict=True):
                assert abs(a - b) <= LOGP_ATOL * max(1.0, abs(b) / 100), (mine, theirs)  # as against HFLM


@pytest.mark.xla
@pytest.mark.parametrize("mesh", [[], ["--mesh", "fsdp=2"]], ids=["one_device", "spmd_fsdp2"])
def test_torch_xla_scores_as_the_cpu(local, ours, tmp_path, mesh):
    """`launch/eval.py --backend xla` on virtual CPU devices: one device (the forward and the KV-cache decoder
    compiled by XLA), and `--mesh fsdp=2` (torch_xla SPMD: the params split, the greedy loop over the forward)."""
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (run with .venv-xla: make install-xla)")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    _assert_same_responses(_eval_script_samples(local, tmp_path, ["--backend", "xla", *mesh], env=env), ours)


def test_sampling_generation_kwargs_are_refused(local):
    folder, _ = local
    lm = EmberLM.from_path(folder, backend="eager", batch_size=2)

    class Request:
        args = ("What is 2 plus 2?", {"until": ["\n"], "do_sample": True, "temperature": 0.7})

    with pytest.raises(ValueError, match="ask for sampling; EmberLM generates greedily"):
        lm.generate_until([Request()])
