"""Tests for the offline test assets and scripts/download_hf_assets.py.

They prove that:
- tests/assets/c4_test loads with datasets exactly as torchtitan's c4_test
  dataset loads it, and is a non-trivial English corpus;
- tests/assets/tokenizer builds through torchtitan's HuggingFaceTokenizer config
  as the trainer builds it, fits the debug vocabulary (<= 2048), has BOS/EOS,
  and round-trips text;
- the download script writes to <local_dir>/<repo name>/, resolves the token
  from --hf_token / HF_TOKEN / the saved login, never shows the token (also on
  failures and argument errors), and turns gated-repo, network and bad-argument
  failures into clear messages without a traceback.

Nothing here touches the network: downloads go through a fake downloader that
copies local files, and the one real-CLI check runs with HF_HUB_OFFLINE=1.

Tier: fast.
Run from the repository root:  .venv/bin/python -m pytest tests/test_assets.py -q
"""

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)

REPO = Path(__file__).resolve().parents[1]
C4_DIR = REPO / "tests" / "assets" / "c4_test"
TOKENIZER_DIR = REPO / "tests" / "assets" / "tokenizer"
SCRIPT = REPO / "scripts" / "download_hf_assets.py"
SECRET = "hf_tEsTsEcReT0123456789abcdefXYZ"
REPO_ID = "meta-llama/Llama-3.1-8B"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    cwd = os.getcwd()
    os.chdir(REPO)  # torchtitan passes the path relative to the repository root
    try:
        return datasets.load_dataset(
            "tests/assets/c4_test", split="train",
            cache_dir=str(tmp_path_factory.mktemp("hf_datasets_cache")))
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def dl():
    spec = importlib.util.spec_from_file_location("download_hf_assets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_c4_test_is_an_english_corpus(corpus):
    texts = corpus["text"]
    assert len(texts) > 500
    assert all(isinstance(t, str) and t.strip() for t in texts)
    assert sum(len(t.encode("utf-8")) for t in texts) > 1_000_000
    assert all(200 <= len(t) <= 3000 for t in texts)
    words = collections.Counter(w for t in texts for w in re.findall(r"[a-z]+", t.lower()))
    top = {w for w, _ in words.most_common(15)}
    assert {"the", "of", "and", "to", "a"} <= top


def test_c4_test_documents_its_source_and_license():
    readme = (C4_DIR / "README.md").read_text()
    assert "python3.11-doc" in readme and "PSF" in readme
    assert "PSF LICENSE AGREEMENT" in (C4_DIR / "LICENSE").read_text()


def test_tokenizer_builds_like_the_trainer(tokenizer, corpus):
    assert tokenizer.get_vocab_size() <= 2048
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    text = "The quick brown fox jumps over the lazy dog.\n  Caf\u00e9, na\u00efve \u2014 \u65e5\u672c"
    for sample in [text, ""] + corpus["text"][:50]:
        ids = tokenizer.encode(sample, add_bos=True, add_eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert all(0 <= i < tokenizer.get_vocab_size() for i in ids)
        assert tokenizer.decode(ids[1:-1]) == sample
        assert tokenizer.decode(ids, skip_special_tokens=True) == sample
    # Trained merges, not bytes: English prose packs several characters a token.
    sample = "\n".join(corpus["text"][:50])
    assert len(sample) / len(tokenizer.encode(sample)) > 3


def _http_error(cls, status, message):
    url = f"https://huggingface.co/{REPO_ID}/resolve/main/file"
    response = httpx.Response(status, request=httpx.Request("GET", url))
    return cls(message, response=response)


def fake_downloader(files, error=None, calls=None):
    """Stands in for hf_hub_download: serves `files` (name -> text) or raises `error`."""

    def download(*, repo_id, filename, local_dir, token):
        if calls is not None:
            calls.append((repo_id, filename, token))
        if error is not None:
            raise error
        if filename not in files:
            raise _http_error(RemoteEntryNotFoundError, 404, f"404 {filename} {token}")
        path = Path(local_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[filename])
        return str(path)

    return download


def fail_download(dl, capsys, caplog, error) -> str:
    """Download the tokenizer with the token on the command line through a
    downloader raising ``error``: exit code 1; the message is returned."""
    rc, _, err = run_main(dl, capsys, caplog,
                          ["--repo_id", REPO_ID, "--assets", "tokenizer", "--hf_token", SECRET],
                          fake_downloader({}, error=error))
    assert rc == 1
    return err


def run_main(dl, capsys, caplog, argv, downloader):
    caplog.set_level("DEBUG")
    rc = dl.main(argv, downloader=downloader)
    out, err = capsys.readouterr()
    assert SECRET not in out + err + caplog.text
    assert "Traceback" not in out + err
    return rc, out, err


def test_download_tokenizer_into_repo_named_folder(dl, clean_env, capsys, caplog):
    files = {name: (TOKENIZER_DIR / name).read_text()
             for name in ("tokenizer.json", "tokenizer_config.json")}
    files["special_tokens_map.json"] = "{}"
    calls = []
    rc, out, _ = run_main(dl, capsys, caplog,
                          ["--repo_id", REPO_ID, "--assets", "tokenizer", "--hf_token", SECRET],
                          fake_downloader(files, calls=calls))
    assert rc == 0
    target = clean_env / "assets" / "hf" / "Llama-3.1-8B"
    assert sorted(p.name for p in target.iterdir()) == sorted(files)
    assert {token for _, _, token in calls} == {SECRET}
    assert "Llama-3.1-8B" in out

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer.Config().build(tokenizer_path="./assets/hf/Llama-3.1-8B")
    assert tok.bos_id is not None and tok.eos_id is not None


def test_token_comes_from_env_then_saved_login(dl, clean_env, monkeypatch):
    files = {"config.json": "{}"}
    calls = []
    dl.download_hf_assets("org/m", ["config"], "out", None, fake_downloader(files, calls=calls))
    assert calls[0][2] is None  # huggingface_hub then uses the saved login
    monkeypatch.setenv("HF_TOKEN", SECRET)
    calls.clear()
    dl.download_hf_assets("org/m", ["config"], "out", None, fake_downloader(files, calls=calls))
    assert calls[0][2] == SECRET
    calls.clear()
    dl.download_hf_assets("org/m", ["config"], "out", "hf_other", fake_downloader(files, calls=calls))
    assert calls[0][2] == "hf_other"
    assert (clean_env / "out" / "m" / "config.json").is_file()


def test_safetensors_follows_the_index(dl, clean_env):
    index = {"weight_map": {"a": "model-00002-of-00002.safetensors",
                            "b": "model-00001-of-00002.safetensors"}}
    files = {"model.safetensors.index.json": json.dumps(index),
             "model-00001-of-00002.safetensors": "x", "model-00002-of-00002.safetensors": "y"}
    paths = dl.download_hf_assets("org/big", ["safetensors"], "hf", None, fake_downloader(files))
    assert sorted(Path(p).name for p in paths) == sorted(files)
    paths = dl.download_hf_assets("org/small", ["safetensors"], "hf", None,
                                  fake_downloader({"model.safetensors": "z"}))
    assert [Path(p).name for p in paths] == ["model.safetensors"]


@pytest.mark.parametrize("error", [
    _http_error(GatedRepoError, 403, f"403 Cannot access gated repo, token {SECRET}"),
    _http_error(RepositoryNotFoundError, 401, f"401 Invalid credentials {SECRET}"),
    _http_error(HfHubHTTPError, 403, f"403 Forbidden for {SECRET}"),
], ids=["gated", "401", "403"])
def test_gated_repo_message(dl, clean_env, capsys, caplog, error):
    err = fail_download(dl, capsys, caplog, error)
    assert "gated" in err and "--hf_token" in err and "HF_TOKEN" in err
    assert f"https://huggingface.co/{REPO_ID}" in err


@pytest.mark.parametrize("error", [
    LocalEntryNotFoundError(f"cannot find the requested files {SECRET}"),
    httpx.ConnectError(f"Name or service not known {SECRET}"),
    ConnectionError("connection reset"),
], ids=["offline", "httpx", "socket"])
def test_network_failure_message(dl, clean_env, capsys, caplog, error):
    err = fail_download(dl, capsys, caplog, error)
    assert "Could not reach the Hugging Face Hub" in err
    assert str(clean_env / "assets" / "hf" / "Llama-3.1-8B") in err


def test_unexpected_error_is_redacted(dl, clean_env, capsys, caplog, monkeypatch):
    error = RuntimeError(f"bad header: Authorization: Bearer {SECRET}")
    rc, _, err = run_main(dl, capsys, caplog,
                          ["--repo_id", REPO_ID, "--assets", "config", "--hf_token", SECRET],
                          fake_downloader({}, error=error))
    assert rc == 1 and "<redacted>" in err
    monkeypatch.setenv("HF_TOKEN", SECRET)
    rc, _, err = run_main(dl, capsys, caplog, ["--repo_id", REPO_ID, "--assets", "config"],
                          fake_downloader({}, error=error))
    assert rc == 1 and "<redacted>" in err


def test_missing_required_file_and_unknown_kind(dl, clean_env, capsys, caplog):
    rc, _, err = run_main(dl, capsys, caplog, ["--repo_id", REPO_ID, "--assets", "tokenizer"],
                          fake_downloader({"tokenizer_config.json": "{}"}))
    assert rc == 1 and "has no file 'tokenizer.json'" in err
    calls = []
    rc, _, err = run_main(dl, capsys, caplog,
                          ["--repo_id", REPO_ID, "--assets", "tokenizer", "weights"],
                          fake_downloader({}, calls=calls))
    assert rc == 1 and not calls
    assert "'weights'" in err and "config, safetensors, tokenizer" in err


def test_argument_errors_hide_the_token(dl, clean_env, capsys, caplog):
    for argv in (["--repo_id", REPO_ID, "--assets", "tokenizer", "--hf-tokn", SECRET],
                 ["--repo_id", REPO_ID, "--assets", "tokenizer", f"--token={SECRET}"]):
        with pytest.raises(SystemExit) as exit_info:
            dl.main(argv, downloader=fake_downloader({}))
        assert exit_info.value.code == 2
        out, err = capsys.readouterr()
        assert SECRET not in out + err and "unrecognized arguments" in err


def test_cli_offline_exits_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--repo_id", REPO_ID, "--assets", "tokenizer",
         "--hf_token", SECRET, "--local_dir", str(tmp_path / "hf")],
        capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1
    assert SECRET not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Could not reach the Hugging Face Hub" in proc.stderr
    assert str(tmp_path / "hf" / "Llama-3.1-8B") in proc.stderr


def test_gpt_oss_download_command_fills_the_20b_recipes_tokenizer_folder(
        dl, clean_env, capsys, caplog):
    """The docs' command (`--repo_id openai/gpt-oss-20b --assets tokenizer`)
    writes where the GPT-OSS 20B recipes read their tokenizer."""
    from torchtitan_neuron.models.gpt_oss.config_registry import gpt_oss_20b_neuron_tp2_fsdp32

    files = {name: (TOKENIZER_DIR / name).read_text()
             for name in ("tokenizer.json", "tokenizer_config.json")}
    rc, out, _ = run_main(dl, capsys, caplog,
                          ["--repo_id", "openai/gpt-oss-20b", "--assets", "tokenizer"],
                          fake_downloader(files))
    assert rc == 0 and "gpt-oss-20b" in out
    recipe_path = gpt_oss_20b_neuron_tp2_fsdp32().hf_assets_path
    assert recipe_path == "./assets/hf/gpt-oss-20b"
    assert sorted(p.name for p in (clean_env / recipe_path).iterdir()) == sorted(files)
