"""LoRA adapters in and out, in peft's format (``torchtitan_neuron/hf/lora.py``).

Proves, on the debug Llama's LoRA recipe (rank 8, alpha 16 on wqkv, wo, w1,
w2, w3), in fp32 on CPU:
- in one process (fast tier): with random adapters, the merged weights in
  transformers, and the peft adapter on the base in peft, give the project
  model's loss within 1e-5 relative; the adapter read back is bit for bit the
  one written; the preflight refuses an adapter folder that does not fit
  (rank, alpha, shapes of another base, q/k/v with different lora_A, no
  folder, no HF base load) and a LoRA converter with rank 0 or a target the
  model lacks, naming the item and the fix;
- on 2 gloo ranks (slow tier), three launches:
  A. from a transformers model's folder, 4 steps, full checkpoints at steps
     2 and 4: its step-1 loss is transformers' on the same first batch
     (prompt tokens -100, each packed conversation alone) within 1e-5
     relative; at step 4 every base tensor equals the imported one bit for
     bit and the optimizer holds state for the adapters only;
  B. resumed from A's step 2 with ``--checkpoint.last_save_in_hf``: steps 3
     and 4 print A's losses bit for bit; its merged export in transformers,
     and its peft adapter on the base folder in peft, give the loss of A's
     step-4 checkpoint in this project within 1e-5 relative;
  C. a new run started from B's adapter (``--checkpoint.initial_load_adapter``):
     its step-1 loss is peft's on the same batch within 1e-5 relative.

Tier: fast (in-process, about 30 s) and slow (three launches, about 2.5 minutes).
Run: .venv/bin/python -m pytest tests/test_lora.py -q
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import run_train
from runlog import run_command

MODULE = "torchtitan_neuron.experiments.graph_trainer.llama3"
RECIPE = "simple_fsdp_llama3_debugmodel_lora"
FP32 = ["--compile.backend", "aot_eager", "--training.mixed_precision_param", "float32",
        "--debug.seed", "0"]


def _model(recipe=RECIPE):
    from torchtitan_neuron.hf.model import build_model

    torch.manual_seed(0)
    return build_model(MODULE, recipe, [])


def _loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).item()


def _write_base(folder, spec, adapter, state):
    from safetensors.torch import save_file

    from torchtitan_neuron import hf

    folder.mkdir(parents=True, exist_ok=True)
    base = {k: v.contiguous() for k, v in adapter.to_hf(
        {k: v for k, v in state.items() if "lora_" not in k}).items()}
    save_file(base, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf.write_hand_off(folder, hf.transformers_config(spec, spec.model, torch.float32),
                      "./tests/assets/tokenizer", [])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The LoRA model with random adapters; its base as an HF folder, its
    merged weights as another and its adapter in peft's format."""
    from safetensors.torch import save_file

    from torchtitan_neuron import hf
    from torchtitan_neuron.hf.lora import LoRAMap

    root = tmp_path_factory.mktemp("lora")
    config, model, adapter = _model()
    spec = config.model_spec
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:  # zero at initialisation: the adapter would do nothing
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    state = model.state_dict()
    _write_base(root / "base", spec, adapter, state)
    lora = LoRAMap.for_model(spec, spec.model, adapter)
    merged = lora.merged(state)
    (root / "merged").mkdir()
    save_file({k: v.contiguous() for k, v in adapter.to_hf(merged).items()},
              str(root / "merged" / "model.safetensors"), metadata={"format": "pt"})
    hf.write_hand_off(root / "merged", hf.transformers_config(spec, spec.model, torch.float32),
                      "./tests/assets/tokenizer", [])
    lora.write_adapter(root / "merged", str(root / "base"), torch.float32)
    return root, model, lora, state


def test_merged_weights_and_peft_adapter_give_the_project_loss(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, model, lora, state = exported
    assert lora.target_modules() == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                     "up_proj", "v_proj"]
    tokens = torch.randint(0, 2048, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = _loss(model(tokens), tokens)
        merged = AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float32)
        base = AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32)
        base_loss = _loss(base.eval()(input_ids=tokens).logits, tokens)
        peft = PeftModel.from_pretrained(base, str(root / "merged" / "adapter")).eval()
        results = {"merged": _loss(merged.eval()(input_ids=tokens).logits, tokens),
                   "peft": _loss(peft(input_ids=tokens).logits, tokens)}
    for name, loss in results.items():
        print(f"lora-figure {name}: {loss:.8f}, project {ours:.8f}, "
              f"rel {abs(loss - ours) / ours:.2e}")
        assert abs(loss - ours) <= 1e-5 * ours, (name, loss, ours)
    assert abs(base_loss - ours) > 1e-4 * ours  # the adapters do change the model
    # Read back: this recipe's lora_a and lora_b, bit for bit.
    back = lora.from_peft(root / "merged" / "adapter")
    assert sorted(back) == sorted(k for k in state if "lora_" in k)
    for name, tensor in back.items():
        assert torch.equal(tensor, state[name]), name
    config = json.loads((root / "merged" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")


def _check(*flags):
    from torchtitan.config import ConfigManager

    from torchtitan_neuron.preflight import check_hf_import

    config = ConfigManager().parse_args(["--module", MODULE, "--config", RECIPE, *flags])
    check_hf_import(config)


def test_the_preflight_refuses_an_adapter_that_does_not_fit(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    from torchtitan_neuron.preflight.errors import PreflightError

    root = exported[0]
    good = root / "merged" / "adapter"
    base = [f"--checkpoint.initial_load_path={root / 'base'}", "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf"]
    _check(*base, f"--checkpoint.initial_load_adapter={good}")

    def variant(name, config=None, tensors=None):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        if config:
            data = json.loads((folder / "adapter_config.json").read_text())
            (folder / "adapter_config.json").write_text(json.dumps({**data, **config}))
        if tensors:
            found = load_file(str(folder / "adapter_model.safetensors"))
            save_file(tensors(found), str(folder / "adapter_model.safetensors"))
        return f"--checkpoint.initial_load_adapter={folder}"

    def other_q_a(found):
        key = "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"
        return {**found, key: found[key] + 1}

    def other_base(found):  # an adapter of a model whose hidden size is 512
        return {k: torch.zeros(v.shape[0], 512) if "lora_A" in k else v
                for k, v in found.items()}

    cases = [
        (variant("rank", {"r": 16}), r"adapter_config.json: r 16 where the recipe's LoRA has 8"),
        (variant("alpha", {"lora_alpha": 32}), r"lora_alpha 32 where the recipe's LoRA has 16"),
        (variant("dims", tensors=other_base),
         r"self_attn.q_proj.lora_A.weight is \[8, 512\], \[8, 256\] expected: the adapter "
         r"was trained on another base model"),
        (variant("qkv", tensors=other_q_a),
         r"the lora_A of q_proj, k_proj, v_proj in layers.2.attention.qkv_linear differ; "
         r"this recipe fuses them into one wqkv"),
        (f"--checkpoint.initial_load_adapter={tmp_path / 'none'}",
         r"is not a peft adapter folder: it needs adapter_config.json and "
         r"adapter_model.safetensors"),
    ]
    for flag, message in cases:
        with pytest.raises(PreflightError, match=message):
            _check(*base, flag)
    with pytest.raises(PreflightError, match=r"pass --checkpoint.enable and "
                       r"--checkpoint.initial_load_in_hf with it"):
        _check(f"--checkpoint.initial_load_adapter={good}")


def test_a_lora_converter_with_rank_0_or_a_missing_target_is_refused(tmp_path, monkeypatch):
    from torchtitan.components.lora import LoRAConverter

    from torchtitan_neuron.preflight import PreflightError
    from torchtitan_neuron.preflight.checks import run_checks

    # A recipe of the user's own, refused by the preflight as it is built.
    (tmp_path / "my_lora.py").write_text(
        "from torchtitan.components.lora import LoRAConverter\n"
        "from torchtitan_neuron.experiments.graph_trainer.llama3 import model_registry  # noqa\n"
        "from torchtitan_neuron.experiments.graph_trainer.llama3 import config_registry as c\n"
        "def my_lora():\n"
        "    return c._neuron_simple_fsdp_llama3_config(c.cpu_rehearsal_llama3_debugmodel,\n"
        "        converters=[LoRAConverter.Config(target_modules=['wq', 'wo'])])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PreflightError, match=r"CONFIG=my_lora cannot be built: "
                       r"LoRAConverter.Config\(target_modules=...\): the model has no linear "
                       r"named wq"):
        run_checks(["--module", "my_lora", "--config", "my_lora"], 2)

    from torchtitan_neuron.components.model_config import check_lora

    config, _, _ = _model("simple_fsdp_llama3_debugmodel")
    with pytest.raises(ValueError, match=r"rank=0\): the LoRA rank must be at least 1"):
        check_lora(LoRAConverter.Config(rank=0), config.model_spec.model)
    with pytest.raises(ValueError, match=r"the model has no linear named q_proj; its linears "
                       r"are lm_head, w1, w2, w3, wo, wqkv"):
        check_lora(LoRAConverter.Config(target_modules=["wo", "q_proj"]),
                   config.model_spec.model)


# ---- the runs (slow tier) ----------------------------------------------------

def _hf_check(*args):
    out = run_command([sys.executable, "-m", "torchtitan_neuron.hf", "check", "--module", MODULE,
                       "--config", RECIPE, "--batch-size", "8", *args], timeout=300)
    assert out.returncode == 0, out.output[-3000:]
    return dict(re.findall(r"(\w+)=(\S+)", out.output.splitlines()[-1]))


def _summary(dump):
    return json.loads((dump / "run_summary.json").read_text())


@pytest.mark.slow
@pytest.mark.e2e
def test_lora_from_released_weights_resumes_exports_and_continues(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from test_hf import _random_transformers_folder

    base = tmp_path / "base"
    _random_transformers_folder(base, "llama3")
    start = ["--checkpoint.enable", f"--checkpoint.initial_load_path={base}",
             "--checkpoint.initial_load_in_hf"]

    # A: 4 steps from the transformers folder, full checkpoints at 2 and 4.
    a = tmp_path / "a"
    run = run_train([*FP32, *start, "--training.steps", "4", "--validator.freq", "4",
                     "--checkpoint.interval", "2"],
                    module=MODULE, config=RECIPE, dump_folder=a)
    assert run.returncode == 0, run.output[-4000:]
    summary = _summary(a)
    trained, total = summary["parameters_trained"], summary["parameters"]
    # 6 blocks x rank 8 x (in + out) of wqkv (256 -> 768), wo (256 -> 256),
    # w1, w3 (256 -> 768) and w2 (768 -> 256).
    assert trained == 6 * 8 * ((256 + 768) + (256 + 256) + 3 * (256 + 768))
    assert f"Training {trained:,} of {total:,} parameters" in run.output
    state = re.search(r"parameters ([\d.]+) MiB, gradients ([\d.]+) MiB, optimizer state "
                      r"([\d.]+) MiB", run.output)
    params, grads, optim = map(float, state.groups())
    assert grads < params / 20 and optim == pytest.approx(2 * grads, rel=0.01)
    # Step 1: lora_b is zero, so the loss is the base model's in transformers
    # on the same first global batch (8 sequences), prompt tokens out of it.
    reference = float(_hf_check("--hf", str(base))["transformers_loss"])
    step1 = summary["loss_first"]
    print(f"lora-figure step-1 {step1:.8f}, transformers {reference:.8f}, "
          f"rel {abs(step1 - reference) / reference:.2e}")
    assert abs(step1 - reference) <= 1e-5 * reference
    # Step 4: the base as imported, bit for bit; optimizer state for adapters only.
    imported = _base_state(base)
    checkpoint = a / "checkpoint" / "step-4"
    names = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    assert set(imported) < set(names)
    frozen = {k: torch.empty_like(v) for k, v in imported.items()}
    dcp.load(frozen, checkpoint_id=str(checkpoint), no_dist=True)
    for name, tensor in frozen.items():
        assert torch.equal(tensor, imported[name]), name
    optimizer = {re.sub(r"^optimizer\.(state|param_groups)\.", "", k).rsplit(".", 1)[0]
                 for k in names if k.startswith("optimizer.")}
    assert optimizer and all(".lora_a." in k or ".lora_b." in k for k in optimizer), optimizer

    # B: resumed from A's step 2, exported at step 4 (merged, and the adapter).
    b = tmp_path / "b"
    (b / "checkpoint").mkdir(parents=True)
    shutil.copytree(a / "checkpoint" / "step-2", b / "checkpoint" / "step-2")
    run = run_train([*FP32, *start, "--training.steps", "4", "--validator.freq", "4",
                     "--checkpoint.interval", "2", "--checkpoint.last_save_model_only",
                     "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "float32"],
                    module=MODULE, config=RECIPE, dump_folder=b)
    assert run.returncode == 0, run.output[-4000:]
    resumed = [row["loss"] for row in _summary(b)["steps"]]
    assert resumed == [row["loss"] for row in summary["steps"]][2:], resumed
    export = b / "checkpoint" / "step-4"
    assert "alone in peft's format in step-4/adapter" in run.output
    for name in ("config.json", "tokenizer.json", "adapter/adapter_config.json",
                 "adapter/adapter_model.safetensors"):
        assert (export / name).is_file(), name
    assert not any("lora" in k for path in export.glob("*.safetensors")
                   for k in load_file(str(path)))
    for label, flags in (("merged", ["--hf", str(export)]),
                         ("peft", ["--hf", str(base), "--adapter", str(export / "adapter")])):
        found = _hf_check(*flags, "--checkpoint", str(checkpoint))
        print(f"lora-figure {label} export: transformers {found['transformers_loss']}, "
              f"project {found['project_loss']}, rel {found['rel']}")
        assert float(found["rel"]) <= 1e-5, found

    # C: a new run continues from B's adapter.
    c = tmp_path / "c"
    run = run_train([*FP32, *start, "--training.steps", "1",
                     f"--checkpoint.initial_load_adapter={export / 'adapter'}"],
                    module=MODULE, config=RECIPE, dump_folder=c)
    assert run.returncode == 0, run.output[-4000:]
    assert "Loaded the LoRA adapters of" in run.output
    ours = _summary(c)["loss_first"]
    peft = float(_hf_check("--hf", str(base), "--adapter", str(export / "adapter"))
                 ["transformers_loss"])
    print(f"lora-figure continued step-1 {ours:.8f}, peft {peft:.8f}, "
          f"rel {abs(ours - peft) / peft:.2e}")
    assert abs(ours - peft) <= 1e-5 * peft


def _base_state(folder):
    """The HF folder's tensors under this recipe's state-dict names."""
    from safetensors.torch import load_file

    from torchtitan_neuron.hf.model import build_model

    config, model, adapter = build_model(MODULE, RECIPE, [])
    hf_state = {}
    for path in sorted(folder.glob("*.safetensors")):
        hf_state.update(load_file(str(path)))
    state = adapter.from_hf(hf_state)
    # wq, wk and wv as the model's state dict names them (split from wqkv).
    model.load_state_dict(state, strict=False)
    return {k: v for k, v in model.state_dict().items() if "lora_" not in k}
