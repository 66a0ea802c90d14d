"""What a new user met on a fresh clone (issue 59), each case from its command line in a fresh process.

Most cases are `launch/train.py` / `launch/ckpt.py` command lines run one after another by one fresh Python
process (`main(argv)` under `run_main`, what `python launch/train.py ARGV` runs), so the imports are paid once;
the cases whose output comes from several processes or native threads (asyncio tracebacks, pipeline ranks,
`make gpu-check`) each start their own. A Hugging Face folder with its own BPE tokenizer and chat template,
and a 50-conversation JSONL, are built here from nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("new_user_sweep")  # one worker runs the module: its batch of commands runs once

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {**{k: v for k, v in os.environ.items() if k not in ("EMBER_DEBUG", "RANK", "WORLD_SIZE", "LOCAL_RANK")},
       "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # ranks (and the pp refusal) on the CPU, a GPU host too
TINY = ["--backend", "eager", "--data.seq_len", "32", "--data.batch_size", "4", "--sample_tokens", "0",
        "--data.max_bytes", "100000"]
ONE_LAYER = ["--model.n_layers", "1", *TINY]
SUFFIX = " (EMBER_DEBUG=1 shows the traceback)"

_BATCH = r"""
import contextlib, importlib, io, json, sys, traceback
from ember.launch.cli import run_main
results = {}
for name, script, argv in json.loads(sys.argv[1]):
    main = importlib.import_module(f"ember.launch.{script}").main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_main(lambda: main(argv))
        except BaseException:
            code, _ = "raised", err.write(traceback.format_exc())
    results[name] = {"code": code, "out": out.getvalue(), "err": err.getvalue()}
print("RESULTS " + json.dumps(results))
"""


def _batch(commands):
    """`{name: {code, out, err}}` of each `(name, script, argv)` run in order by one fresh process."""
    proc = subprocess.run([sys.executable, "-c", _BATCH, json.dumps(commands)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=1200)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(line[-1][len("RESULTS "):])


def _error(result) -> str:
    """The one `error:` line a refused command printed (asserted to be its whole stderr), without the suffix."""
    lines = result["err"].strip().splitlines()
    assert result["code"] == 2 and len(lines) == 1 and lines[0].startswith("error: "), result
    assert lines[0].endswith(SUFFIX), lines
    return lines[0][len("error: "):-len(SUFFIX)]


def _hf_folder(root: pathlib.Path) -> str:
    """A Qwen2 folder of `qwen2_tiny`'s shape with its own BPE tokenizer (not bytes) and a ChatML template."""
    from ember.core import random
    from ember.data import train_bpe
    from ember.launch.run_config import get_config
    from ember.launch.tiny_chat import CHATML, SPECIAL_TOKENS
    from ember.models import build_model, to_hf

    folder = root / "model"
    folder.mkdir()
    cfg = get_config("qwen2_tiny")
    texts = [f"What is {i} plus {i}? {i} plus {i} is {2 * i}." for i in range(200)] + ["system", "user", "assistant"]
    tokenizer = train_bpe(texts, vocab_size=cfg.model.vocab_size, special_tokens=SPECIAL_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML}))
    model = build_model(cfg.family, cfg.model)
    to_hf(model, model.init(random.key(0)), str(folder),
          extra_config={"eos_token_id": tokenizer.tokenizer.token_to_id("<|im_end|>"), "bos_token_id": None})
    return str(folder)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The files a new user points the launchers at, and every batched command's result."""
    root = tmp_path_factory.mktemp("sweep")
    folder = _hf_folder(root)
    chat = root / "chat50.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}) + "\n" for i in range(50)))
    weights = f"{folder}/model.safetensors"  # a binary file a user might point --data.path at
    run, bpe_run = root / "run", root / "bpe_run"
    keep = ["--checkpoint_every", "1", "--keep", "0", "--out", str(run)]
    sft = ["--config", "sft", "--init_from", folder, "--data.seq_len", "256", "--data.batch_size", "4", "--steps", "1",
           "--backend", "eager", "--sample_tokens", "0"]
    commands = [
        ("run", "train", ["--steps", "3", "--eval_every", "3", *keep, *ONE_LAYER]),
        ("resume-layers", "train", ["--resume", "--steps", "4", *keep, *ONE_LAYER, "--model.n_layers", "2"]),
        ("resume-scan", "train", ["--resume", "--steps", "4", *keep, *ONE_LAYER, "--model.scan_layers", "False"]),
        ("export", "ckpt", ["export", str(run), "--hf", "--out", str(root / "hf")]),
        ("init-from-folder", "train", ["--config", "qwen2_tiny", "--init_from", folder, "--steps", "1",
                                       "--eval_every", "0", "--out", str(root / "from_folder"), *TINY]),
        ("sft-binary", "train", [*sft, "--data.path", weights, "--out", str(root / "sft_binary")]),
        ("bin-binary", "train", ["--data.source", "bin", "--data.path", weights, "--steps", "1",
                                 "--out", str(root / "bin_binary"), *ONE_LAYER]),
        ("sft-50", "train", [*sft, "--data.path", str(chat), "--out", str(root / "sft_50")]),
        ("sft-50-no-eval", "train", [*sft, "--data.path", str(chat), "--eval_every", "0",
                                     "--out", str(root / "sft_50_no_eval")]),
        ("family-empty", "train", ["--family", "", "--init_from", folder, "--dry-run"]),
        ("lora-experts", "train", ["--config", "qwen3_moe_tiny", "--lora.rank", "4", "--lora.targets", "gate", "up",
                                   "down", "--dry-run"]),
        ("pp-uneven", "train", ["--nproc-per-node", "2", "--mesh", "pp=2", "--model.scan_layers", "true",
                                "--steps", "1", "--out", str(root / "pp"), *ONE_LAYER]),
        ("bpe-run", "train", ["--data.tokenizer", "bpe", "--data.vocab_size", "300", "--steps", "1",
                              "--checkpoint_every", "0", "--eval_every", "0", "--out", str(bpe_run), *ONE_LAYER]),
        ("bpe-export", "ckpt", ["export", str(bpe_run), "--hf", "--out", str(root / "bpe_hf")]),
    ]
    results = _batch(commands)
    assert results["run"]["code"] == 0 and results["bpe-run"]["code"] == 0, (results["run"], results["bpe-run"])
    return {"root": root, "folder": folder, "run": run, "results": results}


def test_init_from_a_folder_pretrains_with_its_tokenizer(sweep):
    """Case 1: the folder's BPE tokenizer, not bytes, unless --data.tokenizer says otherwise."""
    from ember.launch.run_config import parse_cli

    assert sweep["results"]["init-from-folder"]["code"] == 0, sweep["results"]["init-from-folder"]
    data = json.loads((sweep["root"] / "from_folder" / "config.json").read_text())["data"]
    assert (data["tokenizer"], data["tokenizer_path"]) == ("model", sweep["folder"])
    asked = parse_cli("qwen2_tiny", ["--init_from", sweep["folder"], "--data.tokenizer", "bytes"])
    assert (asked.data.tokenizer, asked.data.tokenizer_path) == ("bytes", None)


def _truncate_largest_array_file(step_dir: pathlib.Path) -> None:
    path = max((p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def test_ckpt_list_of_a_damaged_step_prints_its_verdict_and_no_asyncio_traceback(sweep, tmp_path):
    """Case 2: pending reads of a failed restore used to print 'Event loop is closed' in about half the runs."""
    run = tmp_path / "run"
    shutil.copytree(sweep["run"], run)
    for step in ("2", "3"):  # two damaged steps: two failed reads per listing, each a chance for the race
        _truncate_largest_array_file(run / "checkpoints" / step)
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(ROOT / "launch" / "ckpt.py"), "list", str(run)],
                              capture_output=True, text=True, env=ENV, timeout=300)
        assert proc.returncode == 1 and proc.stderr == "", proc.stderr[-3000:]
        assert "2 damaged steps (2, 3); restore step 1, the newest intact one" in proc.stdout, proc.stdout


def test_resume_after_changing_the_model_names_the_flags_in_one_short_line(sweep):
    """Case 3: which flags differ from the checkpoint and the values to pass."""
    where = f"--resume: the checkpoint of step 3 in {sweep['run']}/checkpoints holds another llama3 model than the run config: "
    assert _error(sweep["results"]["resume-layers"]) == where + (
        "n_layers 1 there, 2 configured. To resume it, set --model.n_layers 1.")
    assert _error(sweep["results"]["resume-scan"]) == where + (
        "scan_layers True there, False configured. To resume it, set --model.scan_layers True.")


def test_bad_data_files_name_the_file_and_the_fix(sweep):
    """Case 4: a binary file as SFT data or as tokens, and a file too small for its held-out eval split."""
    r = sweep["results"]
    weights = f"{sweep['folder']}/model.safetensors"
    assert _error(r["sft-binary"]).startswith(f"{weights} (its first 8192 bytes): not text (a NUL byte): "
                                              f"data.source=sft reads a JSONL file")
    binary = _error(r["bin-binary"])
    assert binary.startswith(f"data.source='bin' reads a token file named *.bin, but data.path={weights!r} is a "
                             f"binary file with another name") and " is text" not in binary, binary
    eval_split = _error(r["sft-50"])
    assert eval_split.startswith(f"the eval split of {sweep['root'] / 'chat50.jsonl'} (every 20th example: 2 of them)")
    assert "pass --eval_every 0 to train without evaluating" in eval_split, eval_split
    assert r["sft-50-no-eval"]["code"] == 0, r["sft-50-no-eval"]  # and that builds no eval split
    assert "eval loss: none (--eval_every 0 evaluates nothing)" in r["sft-50-no-eval"]["out"]


def test_export_of_a_byte_tokenizer_run_writes_a_tokenizer_transformers_loads(sweep):
    """Case 5: the byte run's folder gets a tokenizer.json of the same ids; a BPE run's export says it has none."""
    r = sweep["results"]
    hf = sweep["root"] / "hf"
    assert r["export"]["code"] == 0 and r["export"]["err"] == "", r["export"]
    assert (hf / "tokenizer.json").is_file() and json.loads((hf / "config.json").read_text())["eos_token_id"] == 256
    note = r["bpe-export"]["err"].strip().splitlines()
    assert r["bpe-export"]["code"] == 0 and len(note) == 1 and note[0].startswith(
        "note: no tokenizer written: the run trained its --data.tokenizer bpe in memory and saved none"), note
    transformers = pytest.importorskip("transformers")
    from ember.data import ByteTokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf))
    text = "def héllo():\n    return '→'"
    assert tokenizer(text)["input_ids"] == ByteTokenizer(eos=True).encode(text).tolist()
    assert tokenizer.decode(ByteTokenizer(eos=True).encode(text).tolist()) == text and tokenizer.eos_token_id == 256


_JAX_HABITS = r"""
import json
from ember import optim
from ember.core.pytree import keystr, tree_flatten_with_path, tree_leaves_with_path, tree_map_with_path
tree = {"ln": {"scale": 1.0}}
paths = [keystr(p) for p, _ in tree_flatten_with_path(tree)[0]] + [keystr(p) for p, _ in tree_leaves_with_path(tree)]
paths.append(tree_map_with_path(lambda p, x: keystr(p), tree)["ln"]["scale"])
missing = {}
for name in ["adaptive_grad_clip", "skip_not_finite", "sgdr_schedule", "piecewise_constant_schedule", "contrib"]:
    try:
        getattr(optim, name)
    except AttributeError as error:
        missing[name] = str(error)
print(json.dumps({"paths": paths, "missing": missing}))
"""


def test_jax_and_optax_habits_get_jax_paths_and_ember_names(tmp_path):
    """Case 6: `keystr(path)` is the dotted path in every path API; an optax name ember lacks names what it has."""
    from ember import optim

    proc = subprocess.run([sys.executable, "-c", _JAX_HABITS], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["paths"] == ["ln.scale"] * 3
    instead = {"adaptive_grad_clip": "clip_by_global_norm", "skip_not_finite": "apply_if_finite",
               "sgdr_schedule": "cosine_decay_schedule", "piecewise_constant_schedule": "join_schedules",
               "contrib": "adamw"}
    for name, ours in instead.items():
        assert ours in found["missing"][name] and hasattr(optim, ours), (name, found["missing"][name])
    assert "`ember.core.pytree`" in (ROOT / "README.md").read_text()


def test_help_flags_and_refusals_say_what_is_true(sweep):
    """Case 7: --family "" takes the folder's family; LoRA on experts and an uneven pp name the real reason."""
    r = sweep["results"]
    assert r["family-empty"]["code"] == 0 and "blocks.attn.wq.bias" in r["family-empty"]["out"], r["family-empty"]
    lora = _error(r["lora-experts"])
    assert "is a stacked tensor (as a mixture's experts are stored), not a layer's `.weight`" in lora, lora
    assert "rank >= 2" not in lora
    pp = _error(r["pp-uneven"])
    assert pp.startswith("--mesh pp=2 splits the layers into pp=2 stages, but the model's 1 stacked layer does not "
                         "split into 2 equal stages: pass --model.n_layers 2") and "= 2" not in pp, pp


@pytest.mark.slow  # two gloo ranks, one eager step (about 30 s on 2 cores)
def test_a_pipeline_run_prints_no_vmap_fallback_warning(tmp_path):
    """Case 7: every rank of a pp run printed torch's 'performance drop ... file us an issue' and a source line."""
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--nproc-per-node", "2", "--mesh", "pp=2",
                           "--model.scan_layers", "true", "--model.n_layers", "2", "--steps", "1", "--eval_every", "0",
                           "--out", str(tmp_path / "pp"), *TINY], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "performance drop" not in proc.stderr and "scaled_dot_product_attention(" not in proc.stderr, proc.stderr


def test_gpu_check_outside_the_venv_names_torch_and_gpu_py(tmp_path):
    """Case 7: a python without torch is told to pass GPU_PY=.venv/bin/python, not to fetch wheels."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    bare = tmp_path / "python3"  # a python with the standard library only, as outside .venv
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    env = {**ENV, "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"), "GPU_CHECK_MODE": "cpu"}
    proc = subprocess.run(["make", "-s", "gpu-check", f"GPU_PY={bare}"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    fatal = [line for line in proc.stdout.splitlines() if line.startswith("FATAL")]
    assert proc.returncode != 0 and len(fatal) == 1, proc.stdout + proc.stderr
    assert f"{bare} cannot import torch grain tyro beartype" in fatal[0] and "GPU_PY=.venv/bin/python" in fatal[0]
    assert "make gpu-wheels" not in fatal[0]


def test_the_device_check_summary_says_where_each_matmul_peak_was_measured(tmp_path):
    """Case 7: the env row and the 125M table quoted two different 'measured peaks'."""
    env = {"device": "cuda", "gpu": {"name": "H200"}, "torch": "2.15.0", "cuda": "13.2", "peak_tflops": 782.4,
           "peak_matmul": "8192x8192x8192 bfloat16"}
    steady = {"torch_compiled_bf16": {"median_ms": 100.0, "p25_ms": 99.0, "p75_ms": 101.0, "tokens_per_s": 80000,
                                      "mfu": 0.4, "memory": {"peak_gib": 20.0}}}
    compare = {"config": "llama3_125m", "batch": 8, "seq_len": 1024, "n_params": 129e6, "peak_tflops": 755.1,
               "peak_matmul": "8192x8192x8192 bfloat16", "steady": steady}
    log = (f"===== [env] 10:00:00 timeout 60s: env_probe\nRESULT env {json.dumps(env)}\n===== [env] ok, 9.0s\n"
           f"===== [b1] 10:00:10 timeout 200s: step_compare\nRESULT compare_first_call "
           f"{json.dumps({'variant': 'torch_compiled_bf16', 'first_call_s': 40.0})}\nRESULT compare {json.dumps(compare)}\n"
           f"===== [b1] ok, 120.0s\n")
    (tmp_path / "gpu_check.log").write_text(log)
    (tmp_path / "results.tsv").write_text("env\tok\t9.0\nb1\tok\t120.0\n")
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "device_check" / "summary.py"), "--log",
                           str(tmp_path / "gpu_check.log"), "--results", str(tmp_path / "results.tsv"), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "summary.md").read_text()
    assert "measured peak" not in text and "matmul peak 782" not in text, text
    assert "8192x8192x8192 bfloat16 matmul at the start: 782 TFLOP/s" in text, text
    assert ("MFU against the 8192x8192x8192 bfloat16 matmul peak b1 measured in its own process, 755 TFLOP/s; "
            "env's at the start: 782:") in text, text


def test_no_module_of_the_package_is_over_the_house_limit_of_400_lines():
    """Case 7: `launch/bench_scale.py` had grown to 409 lines (STYLE.md: aim for <= 400, one concept a module)."""
    long = {str(p.relative_to(ROOT)): n for p in sorted(ROOT.rglob("*.py"))
            if not any(part.startswith(".") or part in ("tests", "build") for part in p.relative_to(ROOT).parts)
            and (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines (split them, STYLE.md convention 2): {long}"
