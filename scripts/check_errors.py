"""Run every way a launch can go wrong, as a user would, and report each.

    make check-errors        (or: .venv/bin/python scripts/check_errors.py [CASE ...])

Each case is a real command (``./run_train.sh`` with NGPU/MODULE/CONFIG and
flags, or the download script); it prints one line per case: the case, the
exit code, the seconds until the command exited (for Ctrl-C and a crashing
rank: from the signal or the crash), and the message seen. A case fails
(and the script exits 1) when the exit code or the message is not the
expected one, when it takes longer than its limit, or when a token set in
the environment shows up in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from runlog import (DEBUG_CONFIG as DEBUG, LLAMA_MODULE as LLAMA, Run,  # noqa: E402
                    ctrl_c, free_port, run_command, torchrun, train_env)

DATA = ["--dataloader.dataset", "c4_test", "--hf_assets_path=./tests/assets/tokenizer"]
FAST = [*DATA, "--compile.backend", "aot_eager", "--training.seq_len", "256",
        "--training.local_batch_size", "2", "--metrics.log_freq", "1"]
TOKEN = "hf_checkErrorsNotARealToken0123"


def _env(ngpu: int = 2, module: str = LLAMA, config: str = DEBUG, **extra) -> dict:
    return train_env(ngpu, module, config, env={"PYTHON": sys.executable, "HF_TOKEN": TOKEN,
                                                **extra})


def _run(cmd: list[str], env: dict, timeout: float = 600, **watch) -> Run:
    return run_command(cmd, env, timeout=timeout, **watch)


def _train(args: list[str], **env) -> Run:
    return _run(["./run_train.sh", *args], _env(**env))


def _seconds(out: Run) -> float:
    """Until the command exited: from the marker where the case watches for one."""
    return out.wall_s if out.since_marker_s is None else out.since_marker_s


def _error_line(output: str, pattern: str) -> str:
    for line in output.splitlines():
        if pattern in line:
            return " ".join(line.replace("\u2502", " ").split())
    return ""


# Each case: (name, what it shows, function returning (Run, message, problems)).


def case_short_module(tmp):
    out = _train(FAST, module="llama3")
    return out, _error_line(out.output, "set MODULE="), [
        p for p, bad in (("exit code is not 2", out.returncode != 2),
                         ("a rank started", "[rank" in out.output)) if bad]


def case_import_error(tmp):
    pkg = tmp / "broken_recipes"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config_registry.py").write_text("import not_a_real_package\n")
    out = _run(["./run_train.sh", *FAST],
               _env(module="broken_recipes", config="my_recipe", PYTHONPATH=str(tmp)))
    return out, _error_line(out.output, "failed to import"), [
        p for p, bad in (("exit code is not 2", out.returncode != 2),
                         ("real ImportError not shown", "not_a_real_package" not in out.output))
        if bad]


def case_compile_mode(tmp):
    out = _train([*FAST, "--compile.mode", "aot_fx_trace"])
    text = " ".join(out.output.replace("\u2502", " ").split())
    msg = "jit is the only supported compile mode for SimpleFSDP"
    return out, msg if msg in text else "", [
        p for p, bad in (("exit code is not 2", out.returncode != 2),
                         ("message not printed exactly once", text.count(msg) != 1)) if bad]


def _preflight_case(args, pattern, **env):
    out = _train(args, **env)
    return out, _error_line(out.output, pattern), [
        p for p, bad in (("exit code is not 2", out.returncode != 2),
                         ("a rank started", "[rank" in out.output)) if bad]


def case_missing_tokenizer(tmp):
    return _preflight_case([*FAST, f"--hf_assets_path={tmp}/no-tokenizer"], "--hf_assets_path")


def case_validation_dataset(tmp):
    # A validation folder that is not there: named before any rank starts.
    return _preflight_case([*FAST, "--validator.enable", "--validator.dataloader.dataset",
                            "c4_test", f"--validator.dataloader.dataset_path={tmp}/no-val"],
                           "--validator.dataloader.dataset_path")


def case_gated_download(tmp):
    out = _run([sys.executable, "scripts/download_hf_assets.py", "--repo_id",
                "meta-llama/Llama-3.1-8B", "--assets", "tokenizer",
                "--local_dir", str(tmp / "hf")], _env())
    line = next((l for l in out.output.splitlines() if l.strip()), "")
    return out, line, [p for p, bad in (("exit code is 0", out.returncode == 0),
                                        ("traceback shown", "Traceback" in out.output)) if bad]


def case_c4_offline(tmp):
    args = [a for a in FAST if a not in ("c4_test",)]
    args[args.index("--dataloader.dataset") + 1:args.index("--dataloader.dataset") + 1] = ["c4"]
    return _preflight_case(args, "allenai/c4")


def _dataset_case(tmp, bad_line, pattern):
    folder = tmp / "data"
    folder.mkdir()
    good = json.dumps({"text": "A document."})
    (folder / "data.json").write_text(f"{good}\n{bad_line}\n{good}\n")
    return _preflight_case([*FAST, f"--dataloader.dataset_path={folder}"], pattern)


def case_bad_json_line(tmp):
    return _dataset_case(tmp, '{"text": "cut off', "data.json:2")


def case_missing_text_field(tmp):
    return _dataset_case(tmp, '{"body": "no text"}', "data.json:2")


def case_seq_len_tp(tmp):
    return _preflight_case([*FAST, "--parallelism.tensor_parallel_degree", "2",
                            "--training.seq_len", "250"], "--training.seq_len 250")


def case_global_batch(tmp):
    return _preflight_case([*FAST, "--training.global_batch_size", "6"],
                           "--training.global_batch_size 6")


def case_tp_ngpu(tmp):
    return _preflight_case([*FAST, "--parallelism.tensor_parallel_degree", "2"],
                           "NGPU=3", ngpu=3)


GPT_OSS = "torchtitan_neuron.experiments.graph_trainer.gpt_oss"


def case_gpt_oss_tp_vs_kv_heads(tmp):
    # TP 16 divides NGPU=16 (torchtitan accepts it) but not GPT-OSS's 8 KV heads.
    return _preflight_case([*FAST, "--parallelism.tensor_parallel_degree", "16"],
                           "does not divide GPT-OSS's 8 KV heads", ngpu=16,
                           module=GPT_OSS, config="simple_fsdp_gpt_oss_debugmodel")


def case_gpt_oss_ep_vs_experts(tmp):
    return _preflight_case([*FAST, "--parallelism.expert_parallel_degree", "3",
                            "--training.global_batch_size", "6",
                            "--training.disable_cuda_graphs"],
                           "does not divide GPT-OSS's 8 experts", ngpu=3,
                           module=GPT_OSS, config="simple_fsdp_gpt_oss_debugmodel")


def case_gpt_oss_fsdp_vs_experts(tmp):
    # TP2 on 6 ranks: SimpleFSDP would split the 8 experts over 3 FSDP ranks.
    return _preflight_case([*FAST, "--parallelism.tensor_parallel_degree", "2",
                            "--training.global_batch_size", "6"],
                           "cannot shard GPT-OSS's 8 experts over 3 FSDP ranks", ngpu=6,
                           module=GPT_OSS, config="simple_fsdp_gpt_oss_debugmodel")


def case_pp_stages(tmp):
    # 8 pipeline ranks x 2 virtual stages: 16 stages for the debug model's 8 units.
    return _preflight_case([*FAST, "--parallelism.pipeline_parallel_degree", "8"],
                           "cannot split the model into pipeline stages", ngpu=8)


def case_pp_microbatches(tmp):
    # 1F1B at PP2 with one microbatch: torch's schedule needs one per stage.
    return _preflight_case([*FAST, "--parallelism.pipeline_parallel_degree", "2",
                            "--parallelism.pipeline_parallel_schedule", "1F1B",
                            "--training.local_batch_size", "1"],
                           "needs at least one per stage", ngpu=2)


def case_gpt_oss_cp(tmp):
    return _preflight_case([*FAST, "--parallelism.context_parallel_degree", "2"],
                           "context parallelism here gathers keys and values", ngpu=2,
                           module=GPT_OSS, config="simple_fsdp_gpt_oss_debugmodel")


def case_plan_ep(tmp):
    # An EP rank cannot receive less than the mean of evenly spread tokens.
    out = _run([sys.executable, "-m", "torchtitan_neuron.plan", "--module",
                "torchtitan_neuron.experiments.graph_trainer.deepseek_v3", "--config",
                "simple_fsdp_deepseek_v3_16b_nki_tp4_fsdp16", "--ngpu", "64",
                "--parallelism.tensor_parallel_degree", "1",
                "--parallelism.expert_parallel_degree", "8", "--ep-imbalance", "0.5"], _env())
    return out, _error_line(out.output, "--ep-imbalance 0.5"), [
        p for p, bad in (("exit code is not 2", out.returncode != 2),
                         ("a traceback was printed", "Traceback" in out.output)) if bad]


def case_hf_import_shapes(tmp):
    # A Hugging Face folder whose embedding is not the debug flavor's.
    import torch
    from safetensors.torch import save_file

    folder = tmp / "hf"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)},
              str(folder / "model.safetensors"))
    return _preflight_case([*FAST, "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
                            f"--checkpoint.initial_load_path={folder}",
                            f"--dump_folder={tmp / 'out'}"],
                           "tensor model.embed_tokens.weight is [10, 8] there")


def case_lora_adapter(tmp):
    # A peft adapter for the LoRA recipe without the base weights it starts on.
    return _preflight_case([*FAST, f"--checkpoint.initial_load_adapter={tmp}/adapter",
                            f"--dump_folder={tmp / 'out'}"],
                           "--checkpoint.initial_load_adapter",
                           config="simple_fsdp_llama3_debugmodel_lora")


def case_cpu_oversubscribed(tmp):
    ngpu = (os.cpu_count() or 1) + 1
    out = _train([*FAST, "--training.steps", "1", f"--dump_folder={tmp}"], ngpu=ngpu)
    return out, _error_line(out.output, "oversubscribed"), [
        p for p, bad in (("exit code is not 0", out.returncode != 0),
                         ("no oversubscription note", "oversubscribed" not in out.output))
        if bad]


def case_trn2_on_cpu(tmp):
    # The tutorial's Step 1 command, with NGPU as the tutorial has it.
    return _preflight_case(["--training.steps", "10", "--dataloader.dataset", "c4_test"],
                           "for its sharded state alone", ngpu=64,
                           config="simple_fsdp_llama3_8b_fullac")


def case_ctrl_c(tmp):
    args = [*FAST, "--training.steps", "1000", f"--dump_folder={tmp}"]
    out = _run(["./run_train.sh", *args], _env(), watch="step:  2", then=ctrl_c)
    return out, _error_line(out.output, "SIGINT received"), [
        p for p, bad in (("exit code is not 130", out.returncode != 130),
                         (f"left behind: {sorted(out.left)}", bool(out.left)),
                         ("took over 5 s", not _seconds(out) < 5)) if bad]


def case_rank_crash(tmp):
    cmd = torchrun("tests/helpers/train_crashing_rank.py",
                   [*FAST, "--training.steps", "10", f"--dump_folder={tmp}"],
                   launcher="torchtitan_neuron.launch")
    out = _run(cmd, _env(CRASH_RANK="1", CRASH_AT_STEP="3"), watch="step:  2")
    first = _error_line(out.output, "failed first")
    errors = [l for l in out.output.splitlines() if "Error" in l or "failed first" in l]
    return out, first, [
        p for p, bad in (("exit code is 0", out.returncode == 0),
                         ("root cause not named", "injected failure on rank 1" not in first),
                         ("root cause not the first error printed",
                          not errors or "failed first" not in errors[0]),
                         ("others took over 30 s to stop", not _seconds(out) < 30),
                         (f"left behind: {sorted(out.left)}", bool(out.left)))
        if bad]


def case_nnodes_no_endpoint(tmp):
    env = {k: "" for k in ("RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT")}
    out = _train([*FAST, f"--dump_folder={tmp}"], NNODES="2", **env)
    return out, _error_line(out.output, "needs the rendezvous endpoint"), [
        p for p, bad in (("exit code is not 2", out.returncode != 2),) if bad]


def case_bad_endpoint(tmp):
    out = _train([*FAST, f"--dump_folder={tmp}"], ngpu=1, NNODES="2",
                 RDZV_ENDPOINT="nohost.invalid:29500")
    return out, _error_line(out.output, "does not resolve"), [
        p for p, bad in (("exit code is not 2", out.returncode != 2),) if bad]


def case_peer_missing(tmp):
    port = free_port()
    out = _train([*FAST, f"--dump_folder={tmp}"], ngpu=1, NNODES="2", NODE_RANK="0",
                 RDZV_ENDPOINT=f"localhost:{port}", RDZV_TIMEOUT="10",
                 LOG_DIR=str(tmp / "logs"))
    return out, _error_line(out.output, "not every node joined"), [
        p for p, bad in (("exit code is not 1", out.returncode != 1),
                         ("a traceback was printed", "Traceback" in out.output)) if bad]


CASES = {
    "short-module": case_short_module,
    "import-error": case_import_error,
    "compile-mode": case_compile_mode,
    "missing-tokenizer": case_missing_tokenizer,
    "gated-download": case_gated_download,
    "c4-offline": case_c4_offline,
    "bad-json-line": case_bad_json_line,
    "missing-text-field": case_missing_text_field,
    "seq-len-vs-tp": case_seq_len_tp,
    "global-batch": case_global_batch,
    "tp-vs-ngpu": case_tp_ngpu,
    "gpt-oss-tp-vs-kv-heads": case_gpt_oss_tp_vs_kv_heads,
    "gpt-oss-ep-vs-experts": case_gpt_oss_ep_vs_experts,
    "gpt-oss-fsdp-vs-experts": case_gpt_oss_fsdp_vs_experts,
    "pp-stages": case_pp_stages,
    "validation-dataset": case_validation_dataset,
    "pp-microbatches": case_pp_microbatches,
    "gpt-oss-cp": case_gpt_oss_cp,
    "plan-ep": case_plan_ep,
    "hf-import-shapes": case_hf_import_shapes,
    "lora-adapter": case_lora_adapter,
    "cpu-oversubscribed": case_cpu_oversubscribed,
    "trn2-on-cpu": case_trn2_on_cpu,
    "ctrl-c": case_ctrl_c,
    "rank-crash": case_rank_crash,
    "nnodes-no-endpoint": case_nnodes_no_endpoint,
    "bad-endpoint": case_bad_endpoint,
    "peer-missing": case_peer_missing,
}
LIMIT_S = 60  # a refusal must come within this long (imports included)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", metavar="CASE",
                        help=f"any of: {', '.join(CASES)} (default: all)")
    names = parser.parse_args().cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}; choose from {', '.join(CASES)}")
    failed = 0
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            out, message, problems = CASES[name](Path(tmp))
        if TOKEN in out.output:
            problems.append("the token was printed")
        if not message:
            problems.append("expected message not seen")
        seconds = _seconds(out)
        if name not in ("rank-crash", "cpu-oversubscribed") and seconds > LIMIT_S:
            problems.append(f"took over {LIMIT_S} s")
        status = "ok  " if not problems else "FAIL"
        failed += bool(problems)
        print(f"{status} {name:<19} exit {out.returncode:>3}  {seconds:6.1f}s  "
              f"{message[:220]}" + (f"  [{'; '.join(problems)}]" if problems else ""),
              flush=True)
        if problems:
            print("    " + "\n    ".join(out.output.splitlines()[-15:]), flush=True)
    print(f"{len(names) - failed}/{len(names)} cases as expected", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
