"""Download a model's tokenizer (and optionally config or weights) from the Hugging Face Hub.

Usage (``python scripts/download_hf_assets.py`` from a checkout takes the same
arguments):

    python -m torchtitan_neuron.hf download --repo_id meta-llama/Llama-3.1-8B --assets tokenizer
    python -m torchtitan_neuron.hf download --repo_id R --assets tokenizer config \\
        [--hf_token T] [--local_dir ./assets/hf]

Files are written to <local_dir>/<repo name>/, e.g. ./assets/hf/Llama-3.1-8B/;
point the trainer's --hf_assets_path at that folder. Asset kinds:

    tokenizer    tokenizer.json, tokenizer_config.json, plus tokenizer.model,
                 special_tokens_map.json and chat_template.jinja when the repo has them
    config       config.json, plus generation_config.json when present
    safetensors  model.safetensors.index.json and every shard it lists,
                 or model.safetensors for single-file checkpoints

Gated repos (such as Meta's Llama models) need a token of an account that was
granted access on the repo's page. The token is taken from --hf_token, else
the HF_TOKEN environment variable, else the login saved by `hf auth login`.
It is never printed. Without network access, copy the files into the folder
named above by hand.

download_hf_assets() is the importable entry point; its `downloader` argument
takes anything with hf_hub_download's keyword signature.
"""

import argparse
import json
import os
import sys

from huggingface_hub import get_token, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

try:
    from httpx import TransportError
except ImportError:  # huggingface_hub before 1.0 used requests, whose errors are OSErrors
    TransportError = ConnectionError

# kind -> (required files, files downloaded only when the repo has them)
ASSETS = {
    "tokenizer": (["tokenizer.json", "tokenizer_config.json"],
                  ["tokenizer.model", "special_tokens_map.json", "chat_template.jinja"]),
    "config": (["config.json"], ["generation_config.json"]),
    "safetensors": ([], []),  # the shard list comes from the index file
}
SAFETENSORS_INDEX = "model.safetensors.index.json"
NETWORK_ERRORS = (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError,
                  TimeoutError, TransportError)


class AssetDownloadError(Exception):
    """A download failure, with a message that is safe to show (no token)."""


def redact(text, secrets):
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def target_dir(repo_id, local_dir):
    return os.path.join(local_dir, repo_id.rstrip("/").split("/")[-1])


def _fetch(downloader, repo_id, filename, target, token, optional):
    """Download one file; None when an optional file is not in the repo."""
    try:
        return downloader(repo_id=repo_id, filename=filename, local_dir=target, token=token)
    except NETWORK_ERRORS:
        # Checked first: LocalEntryNotFoundError is also an EntryNotFoundError.
        raise AssetDownloadError(
            f"Could not reach the Hugging Face Hub to download '{filename}' from "
            f"'{repo_id}'. Check the network or proxy settings, or download the "
            f"files on another machine and copy them by hand into "
            f"{os.path.abspath(target)}/") from None
    except Exception as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, GatedRepoError) or (
                isinstance(exc, HfHubHTTPError) and status in (401, 403)):
            # The Hub answers 401 alike for gated, private and misspelled repos.
            code = f" (HTTP {status})" if status else ""
            raise AssetDownloadError(
                f"Access to '{repo_id}' was refused{code}: the repository is gated "
                f"or private, or the name is wrong. Request access at "
                f"https://huggingface.co/{repo_id} with your account, then pass "
                f"--hf_token or set HF_TOKEN (or run `hf auth login`).") from None
        if isinstance(exc, RepositoryNotFoundError):
            raise AssetDownloadError(
                f"The repository '{repo_id}' was not found on the Hugging Face Hub; "
                "check --repo_id.") from None
        if isinstance(exc, EntryNotFoundError):
            if optional:
                return None
            raise AssetDownloadError(
                f"The repository '{repo_id}' has no file '{filename}'.") from None
        # With token=None the library may have used the saved login's token.
        detail = redact(str(exc), [token, os.environ.get("HF_TOKEN"), get_token()])
        raise AssetDownloadError(
            f"Downloading '{filename}' from '{repo_id}' failed: "
            f"{type(exc).__name__}: {detail}") from None


def _probe_hub(repo_id, target):
    """Fail at once when the Hub cannot be reached: hf_hub_download retries
    a failed connection five times with backoff (about 25 s) first."""
    from huggingface_hub import HfApi

    try:
        HfApi().repo_info(repo_id, timeout=10, token=False)
    except NETWORK_ERRORS:
        raise AssetDownloadError(
            f"Could not reach the Hugging Face Hub to download from '{repo_id}'. "
            "Check the network or proxy settings, or download the files on "
            "another machine and copy them by hand into "
            f"{os.path.abspath(target)}/") from None
    except Exception:
        pass  # reachable; gating and missing files are reported per file


def download_hf_assets(repo_id, assets, local_dir="./assets/hf", hf_token=None,
                       downloader=hf_hub_download):
    """Download the given asset kinds of repo_id into <local_dir>/<repo name>/.

    Returns the paths of the files written. Raises AssetDownloadError with a
    message meant for the user (never containing the token) on any failure.
    """
    assets = [assets] if isinstance(assets, str) else list(assets)
    unknown = [kind for kind in assets if kind not in ASSETS]
    if unknown or not assets:
        raise AssetDownloadError(
            f"Unknown asset kind {', '.join(repr(k) for k in unknown) or '(none given)'}; "
            f"valid kinds: {', '.join(sorted(ASSETS))}.")
    # None lets huggingface_hub fall back to the saved login.
    token = hf_token or os.environ.get("HF_TOKEN") or None
    target = target_dir(repo_id, local_dir)
    if downloader is hf_hub_download:
        _probe_hub(repo_id, target)
    os.makedirs(target, exist_ok=True)
    paths = []

    def fetch(filename, optional=False):
        path = _fetch(downloader, repo_id, filename, target, token, optional)
        if path is not None:
            paths.append(path)
        return path

    for kind in dict.fromkeys(assets):
        required, optional = ASSETS[kind]
        for filename in required:
            fetch(filename)
        for filename in optional:
            fetch(filename, optional=True)
        if kind == "safetensors":
            index = fetch(SAFETENSORS_INDEX, optional=True)
            if index is None:
                fetch("model.safetensors")
                continue
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            for shard in shards:
                fetch(shard)
    return paths


class _Parser(argparse.ArgumentParser):
    """argparse echoes bad arguments back; keep a mistyped token out of that."""

    secrets = ()

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {redact(message, self.secrets)}\n")


def _likely_secrets(argv):
    found = [os.environ.get("HF_TOKEN")]
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if "token" in name.lower() and name.startswith("-"):
            found.append(value or (argv[i + 1] if i + 1 < len(argv) else None))
        elif arg.startswith("hf_"):
            found.append(arg)
    return [s for s in found if s]


def main(argv=None, downloader=hf_hub_download):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.secrets = _likely_secrets(argv)
    parser.add_argument("--repo_id", required=True, help="e.g. meta-llama/Llama-3.1-8B")
    parser.add_argument("--assets", nargs="+", required=True,
                        help=f"asset kinds: {', '.join(sorted(ASSETS))}")
    parser.add_argument("--hf_token", "--hf-token", default=None,
                        help="Hub token; default: $HF_TOKEN, else the saved login")
    parser.add_argument("--local_dir", default="./assets/hf",
                        help="parent folder; files go to <local_dir>/<repo name>/")
    args = parser.parse_args(argv)
    try:
        paths = download_hf_assets(args.repo_id, args.assets, args.local_dir,
                                   args.hf_token, downloader)
    except AssetDownloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    print(f"Downloaded {len(paths)} file(s) to {target_dir(args.repo_id, args.local_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
