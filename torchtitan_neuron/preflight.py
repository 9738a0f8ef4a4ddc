"""Validate a run in one process, before any rank starts.

``run_train.sh`` calls ``python -m torchtitan_neuron.preflight --ngpu N
--module M --config C [overrides]`` first, so every mistake below is reported
once, clearly, with exit code 2, instead of by every rank inside torchrun (or
as a hang):

- a recipe module that cannot be found (a short ``MODULE`` such as
  ``llama3`` with a SimpleFSDP recipe name: the message names the module that
  has the recipe), or that fails to import (its real error, which torchtitan
  0.3.0 turns into "Available config functions: []");
- a flag the config does not have, or a refused setting (``--compile.mode``
  other than ``jit`` on a SimpleFSDP recipe); tyro reports these;
- ``NGPU`` above the NeuronCores or GPUs present (the tutorial's hang); on
  CPU more ranks than cores run, with a one-line note;
- layout arithmetic that cannot work: a tensor-parallel degree that does not
  divide the model's query or KV heads, an expert-parallel degree that does
  not divide its experts (``model_layout.py``); parallel degrees that do not divide
  ``NGPU`` (torchtitan's own ``ParallelDims`` decides; its asserts are
  translated into the flags to change), a sequence length the tensor-parallel degree does not divide, a
  global batch that is not a multiple of local batch x data-parallel degree;
- tokenizer files that are not there;
- a dataset that cannot be read: a hub dataset (``c4``) with no network, a
  local folder that is missing, a JSON-lines file with a bad line or a line
  without a ``text`` field (named by file and line number).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
import traceback
from pathlib import Path

# The recipe modules this package ships, searched when a recipe is not where
# MODULE says.
RECIPE_MODULES = (
    "torchtitan_neuron.experiments.graph_trainer.llama3",
    "torchtitan_neuron.experiments.graph_trainer.deepseek_v3",
    "torchtitan_neuron.models.llama3",
    "torchtitan_neuron.models.qwen3",
    "torchtitan_neuron.models.deepseek_v3",
    "torchtitan_neuron.experiments.graph_trainer.gpt_oss",
    "torchtitan_neuron.models.gpt_oss",
)

EXIT_USAGE = 2

# torchtitan's --comm.mode values that run every rank in one process, on fake
# process groups (run_train.sh's COMM_MODE=fake_backend / local_tensor).
SIMULATED_COMM_MODES = ("fake_backend", "local_tensor")


class PreflightError(Exception):
    """A run that cannot work, with what to change."""


def _is_missing(exc: ModuleNotFoundError, candidate: str) -> bool:
    """Whether ``exc`` says ``candidate`` itself (or a package above it) does
    not exist, as opposed to something it imports."""
    missing = exc.name or ""
    return candidate == missing or candidate.startswith(missing + ".")


def _import_error(candidate: str, exc: BaseException) -> PreflightError:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f for f in reversed(frames) if "importlib" not in f.filename), None)
    at = f" ({where.filename}:{where.lineno})" if where else ""
    # The module that failed: the first package on the path that did not
    # finish importing (MODULE itself when "MODULE.config_registry" was tried).
    parts = candidate.split(".")
    failed = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                   if ".".join(parts[:i]) not in sys.modules), candidate)
    return PreflightError(
        f"MODULE={failed} failed to import: {type(exc).__name__}: {exc}{at}. "
        "Fix that import (a missing package: pip install it into the same "
        "environment) and launch again."
    )


def _candidates(module_name: str) -> list[str]:
    """The import paths torchtitan's ConfigManager tries, in its order."""
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    if module_name in _supported_models | _supported_experiments:
        return [f"{prefix}.{module_name}.config_registry" for prefix in
                ("torchtitan.models", "torchtitan.experiments",
                 "torchtitan.experiments.rl.examples")]
    return [f"{module_name}.config_registry", module_name]


def _import_recipe_module(module_name: str):
    for candidate in _candidates(module_name):
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as exc:
            if _is_missing(exc, candidate):
                continue
            raise _import_error(candidate, exc) from None
        except Exception as exc:  # ImportError, SyntaxError, anything it raised
            raise _import_error(candidate, exc) from None
    return None


def _modules_with(config_name: str, skip: str) -> list[str]:
    found = []
    for name in RECIPE_MODULES:
        if name == skip:
            continue
        module = _import_recipe_module(name)
        if module is not None and callable(getattr(module, config_name, None)):
            found.append(name)
    return found


def _recipes(module) -> list[str]:
    return sorted(n for n in dir(module) if not n.startswith("_") and n[0].islower()
                  and callable(getattr(module, n)))


def check_recipe(module_name: str, config_name: str) -> None:
    """MODULE imports and has CONFIG; otherwise say where CONFIG is."""
    module = _import_recipe_module(module_name)
    if module is not None and callable(getattr(module, config_name, None)):
        return
    homes = _modules_with(config_name, skip=module_name)
    where = (f"MODULE={module_name} cannot be imported" if module is None
             else f"CONFIG={config_name} is not a recipe of MODULE={module_name}")
    if homes:
        raise PreflightError(
            f"{where}. {config_name} is in {homes[0]}: set "
            f"MODULE={homes[0]} (MODULE takes the fully qualified path; a short "
            "name such as llama3 resolves to torchtitan's own registry, which has "
            "no SimpleFSDP recipes)."
        )
    if module is None:
        raise PreflightError(
            f"{where}. Recipe modules in this package: {', '.join(RECIPE_MODULES)}."
        )
    close = difflib.get_close_matches(config_name, _recipes(module), n=3)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise PreflightError(
        f"{where}, nor of any recipe module of this package.{hint} "
        f"Recipes in {module_name}: {', '.join(_recipes(module))}."
    )


def check_ngpu(ngpu: int, platform_name: str, devices: int | None,
               cpu_cores: int | None = None) -> str | None:
    """Refuse more ranks than devices; on CPU return a note when ranks
    outnumber cores."""
    if ngpu < 1:
        raise PreflightError(f"NGPU={ngpu}: the number of ranks must be at least 1.")
    if platform_name == "cpu":
        cores = cpu_cores or os.cpu_count() or 1
        if ngpu > cores:
            return (f"NGPU={ngpu} CPU ranks on {cores} cores: ranks share cores "
                    "(oversubscribed), so steps are slower; results are the same.")
        return None
    if devices is not None and ngpu > devices:
        kind = "NeuronCores" if platform_name == "neuron" else "GPUs"
        tool = "neuron-ls" if platform_name == "neuron" else "nvidia-smi"
        raise PreflightError(
            f"NGPU={ngpu} but this host has {devices} {kind} (see {tool}): the "
            f"missing ranks would wait forever. Set NGPU={devices} or fewer."
        )
    return None


# torchtitan's ParallelDims names each degree by its field; these are the
# flags that set them.
_DEGREE_FLAGS = {
    "dp_replicate": "--parallelism.data_parallel_replicate_degree",
    "cp": "--parallelism.context_parallel_degree",
    "tp": "--parallelism.tensor_parallel_degree",
    "pp": "--parallelism.pipeline_parallel_degree",
    "ep": "--parallelism.expert_parallel_degree",
}
# The degrees whose product, with dp_shard, must be the number of ranks.
_MESH_DEGREES = ("dp_replicate", "cp", "tp", "pp")


def _translate_parallel_dims(p, world: int, who: str, exc: AssertionError) -> PreflightError:
    """torchtitan's ParallelDims refused the degrees (an assert with its own
    field names): say which flag is wrong and what to set instead."""
    degrees = {
        "dp_replicate": p.data_parallel_replicate_degree,
        "cp": p.context_parallel_degree,
        "tp": p.tensor_parallel_degree,
        "pp": p.pipeline_parallel_degree,
        "ep": p.expert_parallel_degree,
    }
    for name, degree in degrees.items():
        if degree < 1:
            return PreflightError(
                f"{_DEGREE_FLAGS[name]} {degree}: a parallel degree is at least 1."
            )
    dp_shard = p.data_parallel_shard_degree
    if dp_shard != -1 and dp_shard < 1:
        return PreflightError(
            f"--parallelism.data_parallel_shard_degree {dp_shard}: use -1 (every "
            "rank the other degrees leave) or a degree of at least 1."
        )
    product = 1
    for name in _MESH_DEGREES:
        product *= degrees[name]
    named = " x ".join(f"{_DEGREE_FLAGS[n]} {degrees[n]}" for n in _MESH_DEGREES
                       if degrees[n] > 1) or "1"
    if dp_shard == -1:
        return PreflightError(
            f"{who} is not divisible by {named} = {product}: the "
            "data-parallel shard degree (-1, the rest) would not be whole. "
            f"Use NGPU a multiple of {product}, or degrees whose product "
            f"divides {world}."
        )
    if product * dp_shard != world:
        return PreflightError(
            f"{named} x --parallelism.data_parallel_shard_degree {dp_shard} = "
            f"{product * dp_shard} ranks, but {who}. Set "
            "--parallelism.data_parallel_shard_degree=-1 to shard over the rest, "
            f"or NGPU={product * dp_shard}."
        )
    # A refusal this translation does not know: upstream's own words.
    return PreflightError(f"torchtitan's ParallelDims refused the layout for {who}: {exc}")


def check_layout(config, ngpu: int, nnodes: int = 1) -> dict:
    """The parallel degrees, sequence length and batch sizes fit NGPU ranks.
    Returns the resolved layout. ``ngpu`` is ranks per node; the layout
    spans ``ngpu x nnodes``.

    The degrees are validated by torchtitan's own ``ParallelDims`` (what
    every rank builds), whose refusals are asserts in its field names; they
    are translated here into the flags to change.
    """
    from torchtitan.distributed.parallel_dims import ParallelDims

    world = ngpu * nnodes
    who = f"NGPU={ngpu}" if nnodes == 1 else f"NGPU={ngpu} x NNODES={nnodes} = {world} ranks"
    p, t = config.parallelism, config.training
    try:
        dims = ParallelDims.from_config(p, world)
    except AssertionError as exc:
        raise _translate_parallel_dims(p, world, who, exc) from None
    from torchtitan_neuron.model_layout import model_layout_refusal

    refusal = model_layout_refusal(config, dims.tp, dims.ep, dims.dp_shard)
    if refusal:
        raise PreflightError(refusal)
    divisor = dims.seq_len_divisor
    # Only tensor or context parallelism split a sequence (divisor 2 alone is
    # the CP load-balancing factor with no CP).
    if divisor > 2 and t.seq_len % divisor:
        fix = -(-t.seq_len // divisor) * divisor
        raise PreflightError(
            f"--training.seq_len {t.seq_len} is not divisible by {divisor} "
            f"(2 x tensor-parallel degree {dims.tp} x context-parallel degree {dims.cp}: "
            "sequence parallelism splits each sequence across the TP ranks). "
            f"Use --training.seq_len {fix}, or another multiple of {divisor}."
        )
    if t.local_batch_size < 1:
        raise PreflightError(f"--training.local_batch_size {t.local_batch_size}: at least 1.")
    # torchtitan's Trainer asserts this after building the mesh, on every rank.
    dp = dims.dp_replicate * dims.dp_shard
    per_step = t.local_batch_size * dp
    if t.global_batch_size > 0 and t.global_batch_size % per_step:
        lower = max(per_step, t.global_batch_size // per_step * per_step)
        raise PreflightError(
            f"--training.global_batch_size {t.global_batch_size} is not a multiple "
            f"of --training.local_batch_size {t.local_batch_size} x data-parallel "
            f"degree {dp} = {per_step} sequences per accumulation step. Use "
            f"--training.global_batch_size {lower} or {lower + per_step}, or "
            "another multiple."
        )
    return {"tp": dims.tp, "dp_shard": dims.dp_shard, "dp": dp}


def check_tokenizer(config) -> None:
    """The tokenizer files the recipe names exist (the HF hub is never
    contacted here: a download is a separate, explicit step)."""
    path = config.hf_assets_path
    if not path:
        return
    folder = Path(path)
    download = ("python -m torchtitan_neuron.hf download --repo_id <org/model> "
                "--assets tokenizer (gated repositories also need --hf_token "
                "or HF_TOKEN)")
    if not folder.is_dir():
        raise PreflightError(
            f"--hf_assets_path={path}: no such folder, so there is no tokenizer "
            f"to load. Download it with {download}, or point --hf_assets_path at "
            "a folder that has tokenizer.json (./tests/assets/tokenizer is the "
            "bundled one)."
        )
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise PreflightError(
            f"--hf_assets_path={path} has no tokenizer.json or tokenizer.model. "
            f"Download the tokenizer into it with {download}."
        )


# Datasets torchtitan streams from the Hugging Face Hub unless
# --dataloader.dataset_path points at a local copy.
HUB_DATASETS = {"c4": "allenai/c4", "c4_validation": "allenai/c4"}
TEXT_FIELD = "text"  # what torchtitan's c4 sample processor reads


def _hub_unreachable(repo_id: str) -> str | None:
    """Why the hub cannot serve ``repo_id`` now, or None if it can."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import HfApi

    try:
        HfApi().dataset_info(repo_id, timeout=10)
    except Exception as exc:  # no DNS, refused, timed out, HTTP error
        return f"{type(exc).__name__}: {exc}"
    return None


def check_json_lines(folder: Path, field: str = TEXT_FIELD) -> None:
    """Every line of every ``.json``/``.jsonl`` file under ``folder`` is a
    JSON object with a ``field`` string; the first that is not is named with
    its file and line number."""
    import json

    files = sorted(p for p in folder.rglob("*") if p.suffix in (".json", ".jsonl")
                   and p.is_file() and not p.name.startswith("."))
    for path in files:
        if path.name in ("dataset_info.json", "dataset_dict.json", "state.json"):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    raise PreflightError(
                        f"{path}:{number}: not valid JSON ({exc.msg} at column "
                        f"{exc.colno}). Each line of a JSON-lines dataset is one "
                        f"object such as {{\"{field}\": \"...\"}}; fix or remove "
                        "that line."
                    ) from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise PreflightError(
                        f"{path}:{number}: no \"{field}\" string field (found "
                        f"{keys}). The loader reads each document's text from "
                        f"\"{field}\"; fix or remove that line."
                    )


def check_dataset(config) -> None:
    """The dataset can be read: a local folder exists and its JSON lines are
    sound; a hub dataset is reachable."""
    dl = config.dataloader
    name = getattr(dl, "dataset", None)
    if name is None:
        return
    path = getattr(dl, "dataset_path", None)
    if not path and name in HUB_DATASETS:
        why = _hub_unreachable(HUB_DATASETS[name])
        if why:
            raise PreflightError(
                f"--dataloader.dataset {name} streams {HUB_DATASETS[name]} from the "
                f"Hugging Face Hub, which cannot be reached ({why}). Use "
                "--dataloader.dataset c4_test for the bundled sample, or pass "
                "--dataloader.dataset_path <folder> with a local copy laid out "
                f"like {HUB_DATASETS[name]} (an en/ folder of c4-train.*.json.gz)."
            )
        return
    if not path:
        from torchtitan.hf_datasets.text_datasets import DATASETS

        if name not in DATASETS:
            return  # torchtitan's own message lists the datasets it has
        path = DATASETS[name].path
    folder = Path(path)
    if "/" in path and not folder.exists() and not path.startswith((".", "/")):
        return  # a hub id such as org/name: datasets resolves it
    if not folder.exists():
        raise PreflightError(
            f"--dataloader.dataset_path={path}: no such file or folder "
            f"(dataset {name}). Run from the repository root for the bundled "
            "c4_test, or pass the folder that holds the data."
        )
    if folder.is_dir():
        check_json_lines(folder)


def check_endpoint(endpoint: str) -> None:
    """The rendezvous endpoint of a multi-node run is host:port and the host
    resolves (a name that does not would cost minutes of connect retries)."""
    import socket

    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PreflightError(
            f"RDZV_ENDPOINT={endpoint!r} is not host:port. Set it to the first "
            "node's hostname and a free port, e.g. RDZV_ENDPOINT=trn-0:29500."
        )
    try:
        socket.getaddrinfo(host, int(port))
    except OSError as exc:
        raise PreflightError(
            f"RDZV_ENDPOINT={endpoint}: the host {host!r} does not resolve "
            f"({exc.strerror or exc}). Use the first node's hostname or IP "
            "address as every node sees it."
        ) from None


def run_checks(argv: list[str], ngpu: int, nnodes: int = 1) -> list[str]:
    """Every check; returns notes to print. Raises PreflightError or exits
    with tyro's code 2 on a bad flag."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--module")
    parser.add_argument("--config")
    known, _ = parser.parse_known_args(argv)
    if known.module and known.config:
        check_recipe(known.module, known.config)

    from torchtitan.config import ConfigManager

    from torchtitan_neuron import devices

    if nnodes > 1:
        check_endpoint(os.environ.get("RDZV_ENDPOINT", ""))
    config = ConfigManager().parse_args(argv)
    notes = []
    if config.comm.mode in SIMULATED_COMM_MODES:
        # One process simulates the NGPU ranks: no device per rank is needed.
        check_ngpu(ngpu, "cpu", None, cpu_cores=ngpu)
    else:
        name = devices.detect().name
        note = check_ngpu(ngpu, name, devices.device_count(name))
        if note:
            notes.append(note)
    check_layout(config, ngpu, nnodes)
    if config.comm.mode not in SIMULATED_COMM_MODES and devices.detect().name == "cpu":
        from torchtitan_neuron.host_memory_check import check_host_memory

        refusal = check_host_memory(config, ngpu, known.module, known.config)
        if refusal:
            raise PreflightError(refusal)
    check_tokenizer(config)
    check_dataset(config)
    check_hf_import(config)
    return notes


def check_hf_import(config) -> None:
    """An HF folder the run starts from (``--checkpoint.initial_load_in_hf``)
    holds the tensors, with the shapes, the recipe's flavor expects: read
    from the safetensors headers, before any rank starts (inside DCP a
    mismatch is a traceback on every rank, and a missing tensor is silently
    left at its random initial value)."""
    ckpt = config.checkpoint
    if not (ckpt.enable and ckpt.initial_load_in_hf):
        return
    folder = Path(config.dump_folder) / ckpt.folder
    if folder.is_dir() and any(re.fullmatch(r"step-\d+", p.name) for p in folder.iterdir()):
        return  # resuming: torchtitan ignores the initial load
    source = ckpt.initial_load_path or config.hf_assets_path
    flag = ("--checkpoint.initial_load_path" if ckpt.initial_load_path
            else "--hf_assets_path")
    if not source or not Path(source).is_dir():
        raise PreflightError(
            f"--checkpoint.initial_load_in_hf: {flag} {source!r} is not a folder. "
            "Pass the Hugging Face folder with --checkpoint.initial_load_path "
            "(an absolute path).")
    from torchtitan_neuron import hf

    spec = config.model_spec
    if ckpt.initial_load_in_hf_quantized and hf.family(spec) == "gpt_oss":
        raise PreflightError(
            "--checkpoint.initial_load_in_hf_quantized: importing GPT-OSS's MXFP4 "
            "weights is not supported. Dequantize them to bf16 first (docs/hf.md: "
            "transformers' Mxfp4Config(dequantize=True), then save_pretrained) and "
            "import that folder without the flag.")
    if ckpt.initial_load_in_hf_quantized:
        return  # quantized folders name their tensors differently
    if spec.state_dict_adapter is None:
        raise PreflightError(
            f"--checkpoint.initial_load_in_hf: model {spec.name!r} has no Hugging "
            "Face state-dict adapter; start it from a DCP checkpoint instead.")
    spec.model.update_from_config(config=config)
    refusal = hf.import_refusal(spec, spec.model, source, hf.family_flavors(spec))
    if refusal:
        raise PreflightError(f"{flag} {refusal}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ngpu = os.environ.get("NGPU", "1")
    if argv[:1] == ["--ngpu"] and len(argv) > 1:
        ngpu, argv = argv[1], argv[2:]
    elif argv[:1] and argv[0].startswith("--ngpu="):
        ngpu, argv = argv[0].split("=", 1)[1], argv[1:]
    if not ngpu.isdigit():
        print(f"Error: NGPU={ngpu!r} is not a number of ranks; set NGPU to a "
              "whole number such as 2.", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    ngpu = int(ngpu)
    nnodes = os.environ.get("NNODES", "1") or "1"
    if not nnodes.isdigit() or int(nnodes) < 1:
        print(f"Error: NNODES={nnodes!r} is not a number of nodes; set NNODES to a "
              "whole number such as 2 (or leave it unset for one node).",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    nnodes = int(nnodes)

    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    from torchtitan_neuron import devices
    from torchtitan_neuron.devices import known_warnings

    known_warnings.install(devices.detect().name)
    try:
        notes = run_checks(argv, ngpu, nnodes)
    except PreflightError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    for note in notes:
        logger.warning(note)


if __name__ == "__main__":
    main()
