"""Shared settings: the fast CPU flags and ``run_train``, which launches
``./run_train.sh`` through scripts/runlog.py (the launcher the scripts and
benchmarks use too) with the tests' defaults."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from runlog import DEBUG_CONFIG, LLAMA_MODULE, Run, launch  # noqa: E402

# Small, fast settings for CPU runs in tests: aot_eager compiles in seconds
# where inductor's C++ codegen takes about a minute cold; fp32 parameters,
# because a CPU without native bf16 matrix multiplies (no AVX512-BF16 or AMX,
# e.g. AMD EPYC before Zen 4) runs torch's bf16 mm about 50 times slower
# than fp32 (docs/troubleshooting.md). Tests of the bf16 path ask for it
# with BF16.
FAST = [
    "--dataloader.dataset", "c4_test",
    "--hf_assets_path=./tests/assets/tokenizer",
    "--compile.backend", "aot_eager",
    "--training.seq_len", "256",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--debug.seed", "0",
    "--training.mixed_precision_param", "float32",
]
BF16 = ["--training.mixed_precision_param", "bfloat16"]


def run_train(
    args: list[str],
    *,
    ngpu: int = 2,
    config: str = DEBUG_CONFIG,
    module: str = LLAMA_MODULE,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    dump_folder: Path | None = None,
    preflight: bool = False,
    **options,
) -> Run:
    """Run ./run_train.sh as a user would; rank 0's output is returned.

    The one-process config check (8 s of CPU a launch) runs only where a test
    asks for it (``preflight=True``): the tests of the checks themselves and
    the default rehearsal. Every other launch here is a config already checked.
    """
    return launch(args, ngpu=ngpu, module=module, config=config,
                  env={"PYTHON": sys.executable, **(env or {})}, preflight=preflight,
                  dump_folder=dump_folder, timeout=timeout, **options)


@pytest.fixture
def dump_folder(tmp_path):
    return tmp_path / "outputs"


@pytest.fixture
def run():
    return run_train
