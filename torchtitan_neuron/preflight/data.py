"""What a run reads before its first step: the tokenizer files, the
dataset (a hub dataset reachable, a local folder present, every JSON line
sound, named by file and line), and a multi-node run's rendezvous endpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan_neuron.preflight.errors import PreflightError


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
    """The datasets can be read, the training one and, with the validator on,
    the one it validates on (``held_out_validation`` chooses it): a local
    folder exists and its JSON lines are sound; a hub dataset is reachable."""
    from torchtitan_neuron.data import held_out_validation

    _check_loader(config.dataloader, "--dataloader", config.hf_assets_path)
    if held_out_validation(config):
        _check_loader(config.validator.dataloader, "--validator.dataloader",
                      config.hf_assets_path)


def check_chat_lines(data: Path) -> None:
    """Every line of a chat dataset's ``data.json`` is ``{"messages": [user,
    assistant]}``, each turn a role and a content string; the first that is
    not is named with its line number."""
    import json

    example = ('{"messages": [{"role": "user", "content": "..."}, '
               '{"role": "assistant", "content": "..."}]}')
    with open(data, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                record, why = None, f"not valid JSON ({exc.msg} at column {exc.colno})"
            else:
                turns = record.get("messages") if isinstance(record, dict) else None
                roles = [t.get("role") for t in turns if isinstance(t, dict)] if isinstance(
                    turns, list) else None
                good = roles == ["user", "assistant"] and all(
                    isinstance(t.get("content"), str) for t in turns)
                why = None if good else f"messages with roles {roles}"
            if why:
                raise PreflightError(
                    f"{data}:{number}: {why}. Each line of a chat dataset is one user "
                    f"turn then one assistant turn: {example}; fix or remove that line.")


def check_chat_template(assets: str | None, data: Path, flag: str, name: str) -> None:
    """Conversations can be formatted: the tokenizer has a chat template (a
    ``chat_template.jinja`` beside it, or ``chat_template`` in its
    ``tokenizer_config.json``, as torchtitan's tokenizer reads them), or the
    chat folder has one."""
    import json

    if not assets or not Path(assets).is_dir():
        return  # the tokenizer check names a missing tokenizer
    folder = Path(assets)
    config = folder / "tokenizer_config.json"
    if (folder / "chat_template.jinja").is_file() or (data.parent / "chat_template.jinja").is_file():
        return
    if config.is_file() and "chat_template" in json.loads(config.read_text()):
        return
    raise PreflightError(
        f"{flag}.dataset {name}: the tokenizer in {folder} has no chat template (no "
        "chat_template.jinja, no chat_template in tokenizer_config.json) and "
        f"{data.parent / 'chat_template.jinja'} does not exist: put a Jinja chat template "
        "in either, or use a tokenizer that has one.")


def _check_loader(dl, flag: str, assets: str | None = None) -> None:
    from torchtitan_neuron.data import CHAT_DATASETS, chat_data

    name = getattr(dl, "dataset", None)
    if name is None:
        return
    path = getattr(dl, "dataset_path", None)
    if name in CHAT_DATASETS:
        try:
            data = chat_data(name, path, flag)
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
        check_chat_lines(data)
        check_chat_template(assets, data, flag, name)
        return
    if not path and name in HUB_DATASETS:
        why = _hub_unreachable(HUB_DATASETS[name])
        if why:
            raise PreflightError(
                f"{flag}.dataset {name} streams {HUB_DATASETS[name]} from the "
                f"Hugging Face Hub, which cannot be reached ({why}). Use "
                f"{flag}.dataset c4_test for the bundled sample, or pass "
                f"{flag}.dataset_path <folder> with a local copy laid out "
                f"like {HUB_DATASETS[name]} (an en/ folder of c4-train.*.json.gz)."
                + (" Without a dataset of its own the validator reads a held-out "
                   "part of the training data." if flag.startswith("--validator") else "")
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
            f"{flag}.dataset_path={path}: no such file or folder "
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
