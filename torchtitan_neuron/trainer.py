"""The trainer additions every Neuron recipe shares (``NeuronTrainerMixin``),
and ``NeuronTrainer``, torchtitan's Trainer with them. The SimpleFSDP
recipes' ``NeuronGraphTrainer`` is in
``torchtitan_neuron.experiments.graph_trainer.trainer``.

- The compile backend a recipe names (``neuron``) is resolved for the platform
  before anything is compiled, and logged once.
- ``grad_clip`` in ``--compile.components`` compiles gradient-norm clipping
  (torchtitan 0.3.0 always runs it eagerly).
- With ``--debug.seed`` the initial weights do not depend on the layout
  (``torchtitan_neuron.seeded_init``).
- A non-finite loss or gradient norm stops the run on the step where it
  appears, before the optimizer applies that step's update.
- The metrics processor and the checkpoint manager are this project's
  subclasses of torchtitan's (``run_report.NeuronMetricsProcessor``,
  ``checkpoint.NeuronCheckpointManager``), which the recipes name; a config
  that names torchtitan's own gets them here.
- ``config.build(step_hook=StepHook(...))`` changes how a step runs when it
  is traced rather than trained (the memory planner traces it on
  FakeTensors): which gradient clipping runs, and whether the trainer may
  read tensor values (checks, notes, metrics). A training run passes none.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake

import torchtitan.distributed.utils as dist_utils
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from torchtitan_neuron import devices, run_report
from torchtitan_neuron.data import held_out_validation
from torchtitan_neuron.validation import TrainerBatchValidator
from torchtitan_neuron.checkpoint import NeuronCheckpointManager
from torchtitan_neuron.hf import export_hand_off, unexpressed_import_skip
from torchtitan_neuron.hf.lora import adapter_loader
from torchtitan_neuron.run_report import NeuronMetricsProcessor
from torchtitan_neuron.config_utils import promote
from torchtitan_neuron.seeded_init import layout_invariant_init
from torchtitan_neuron.memory_accounting.sharded_state import (
    sharded_state_bytes, step_start_state)
from torchtitan_neuron.memory_accounting.storage_tracker import StorageTracker, instrument
from torchtitan_neuron.components.documents import (
    ModelOptions,
    apply_model_options,
    block_causal_mask,
    cross_document_share,
    document_ids,
    document_positions,
    document_starts,
)
from torchtitan_neuron.components.context_parallel import (
    local_attention_mask,
    rank_positions,
    token_order,
)

GRAD_CLIP_COMPONENT = "grad_clip"
# Set to a step number to measure that step's tensor memory on the real
# tensors (the planner's tracker, on real storage): what the planner predicts.
MEASURE_MEMORY_ENV = "TORCHTITAN_NEURON_MEASURE_MEMORY_STEP"


def neuron_compile_config() -> CompileConfig:
    """torch.compile on the ``neuron`` backend over the model, the loss and
    gradient-norm clipping: what every compiled Neuron recipe turns on."""
    return CompileConfig(
        enable=True,
        components=["model", "loss", GRAD_CLIP_COMPONENT],
        backend=devices.NEURON_COMPILE_BACKEND,
    )


@contextlib.contextmanager
def grad_clip_override(clip_fn):
    """Run torchtitan's train step with ``clip_fn`` as its gradient clipper.

    ``Trainer.train_step`` calls ``torchtitan.distributed.utils.clip_grad_norm_``
    inline; swapping that module attribute for the duration of one step is the
    only way to compile it without copying ``train_step``. ``None`` leaves the
    eager function in place.
    """
    if clip_fn is None:
        yield
        return
    eager = dist_utils.clip_grad_norm_
    dist_utils.clip_grad_norm_ = clip_fn
    try:
        yield
    finally:
        dist_utils.clip_grad_norm_ = eager


def resolve_compile_backend(compile_config: CompileConfig) -> None:
    """Replace a platform-bound backend (``neuron``) with the local compiler."""
    plat = devices.current()
    requested = compile_config.backend
    resolved = plat.resolve_compile_backend(requested)
    if resolved != requested:
        logger.info(
            f"Compile backend '{requested}' resolves to '{resolved}' on "
            f"{plat.name} (torch-neuronx is not installed)"
        )
        compile_config.backend = resolved


def compile_grad_clip(backend: str):
    """torchtitan's ``clip_grad_norm_`` compiled with ``backend``.

    Same function, same arguments, so the clipped gradients and the returned
    norm are those of the eager path, computed by one compiled graph (norms,
    the cross-rank reduction of the DTensor norm, and the scaling).
    """
    return torch.compile(dist_utils.clip_grad_norm_, backend=backend)


def _force_sum_reductions_on_gloo(model_parts) -> None:
    """FSDP2 reduce-scatters with PREMUL_SUM when torchtitan sets a gradient
    divide factor; gloo has no PREMUL_SUM. Sum, then scale, instead."""
    if devices.current().has_premul_sum:
        return
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


@dataclass(frozen=True)
class StepHook:
    """How a step that is traced rather than trained runs.

    Passed as ``config.build(step_hook=...)`` and kept as
    ``trainer.step_hook``; the default is a training run.
    """

    wrap_clip: Callable[[Callable], Callable] | None = None
    """Given the run's compiled gradient clipping (the ``grad_clip`` compile
    component), returns the clipping the step runs instead; unused when
    clipping is not compiled."""

    read_values: bool = True
    """False when the step runs on FakeTensors: the trainer then reads no
    tensor value (no non-finite check, no note on packed documents, and no
    metrics line, whose loss is a value)."""


class QuietMetricsProcessor(NeuronMetricsProcessor):
    """The metrics processor that never logs: a step without values has no
    loss to log (``StepHook.read_values``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(NeuronMetricsProcessor.Config):
        pass

    def should_log(self, step: int) -> bool:
        return False


class NonFiniteError(RuntimeError):
    """A step produced a NaN or inf loss or gradient norm."""


def neuron_components(config) -> None:
    """This project's metrics processor and checkpoint manager where
    ``config`` names torchtitan's own (a recipe names them already)."""
    if type(config.metrics) is MetricsProcessor.Config:
        config.metrics = promote(config.metrics, NeuronMetricsProcessor.Config)
    if type(config.checkpoint) is CheckpointManager.Config:
        config.checkpoint = promote(config.checkpoint, NeuronCheckpointManager.Config)


def cuda_graphs_apply() -> bool:
    """Whether torchtitan's CUDA-graph checks apply: only on CUDA.

    ``Trainer.Config._validate_cuda_graphs`` refuses pipeline parallelism and
    expert parallelism's synchronizing token dispatch unless
    ``--training.disable_cuda_graphs`` is set, on any platform; off CUDA
    torchtitan never captures a graph (``wrap_with_cuda_graph`` runs the step
    as it is), and the flag would change ``zero_grad`` to free the gradients
    every step. The refusal is skipped where no graph is captured."""
    return devices.detect().name == "cuda"


class ProcessPeak:
    """The process's resident memory over one step on CPU, an allocator-side
    measure beside the tensor tracker's. As the step starts the allocator
    hands its free blocks back to the system (``release_free_memory``) and
    the peak resident set (``VmHWM``) is reset; the step's peak resident set,
    less what was resident then and was not a tensor (Python, libraries,
    compiled code), is the allocator's peak for the step's tensors. Linux
    only; None elsewhere (docs/planner.md, "Against the allocator")."""

    def __init__(self, start_bytes: int):
        self.start_bytes = start_bytes

    @classmethod
    def start(cls) -> "ProcessPeak | None":
        from torchtitan_neuron.devices.cpu import read_status_kib, reset_peak_rss

        from torchtitan_neuron.devices.cpu_allocator import release_free_memory

        if devices.current().name != "cpu" or not release_free_memory() or not reset_peak_rss():
            return None
        return cls(read_status_kib("VmRSS") * 1024)

    def describe(self, tensors_at_start: int) -> str:
        from torchtitan_neuron.devices.cpu import read_status_kib

        gib = 1024**3
        peak = read_status_kib("VmHWM") * 1024
        other = self.start_bytes - tensors_at_start
        return (f"Process memory at step: process_peak_gib={peak / gib:.4f} "
                f"resident_at_start_gib={self.start_bytes / gib:.4f} "
                f"non_tensor_at_start_gib={other / gib:.4f} "
                f"allocator_peak_gib={(peak - other) / gib:.4f}")


class NeuronTrainerMixin:
    """What every Neuron recipe's trainer adds to torchtitan's: the config
    prepared before the build, the pieces wired after it, and the step
    guarded (the module docstring lists each)."""

    def __init__(self, config, *, step_hook: StepHook | None = None):
        self.step_hook = step_hook or StepHook()
        self._documents_noted = False
        self._cp_order_checked = False
        self._prepare(config)
        seed = config.debug.seed
        with layout_invariant_init(seed):
            super().__init__(config)
        if seed is not None:
            logger.info(
                f"Initial weights drawn per parameter from seed {seed}, "
                "independent of the parallel layout"
            )
        self.trainable_parameters = trainable_parameters(self.model_parts)
        if self.trainable_parameters[0] < self.trainable_parameters[1]:
            trained, total = self.trainable_parameters
            logger.info(f"Training {trained:,} of {total:,} parameters ({trained / total:.2%}); "
                        "the others are frozen: no gradient, no optimizer state")
        if isinstance(getattr(self, "validator", None), TrainerBatchValidator):
            self.validator.prepare = self.post_dataloading_process
        _force_sum_reductions_on_gloo(self.model_parts)
        self._open_hf_doors()
        self._clip_then_check = self._guarded(self._gradient_clipping())
        if isinstance(self.metrics_processor, NeuronMetricsProcessor):
            self.metrics_processor.grad_accum_steps = self.gradient_accumulation_steps
        self._step_loss: torch.Tensor | None = None
        self._compile_progress = None
        self._measure_step = int(os.environ.get(MEASURE_MEMORY_ENV, "0") or 0)
        self._tracker = None
        if self._measure_step > 0:
            self._tracker = StorageTracker()
            instrument(self, self._tracker)

    def _prepare(self, config) -> None:
        """The config, before torchtitan builds anything from it: this
        project's components, the platform installed, the compile backend
        resolved, the model options applied."""
        neuron_components(config)
        validation = held_out_validation(config)
        if validation:
            logger.info(f"Validation every {config.validator.freq} steps reads {validation}")
            if type(config.validator) is Validator.Config:
                config.validator = promote(config.validator, TrainerBatchValidator.Config)
        if not self.step_hook.read_values:
            config.metrics = promote(config.metrics, QuietMetricsProcessor.Config)
        devices.install()
        resolve_compile_backend(config.compile)
        options = config.model
        if options.reset_positions_per_document and devices.current().is_neuron:
            raise ValueError(
                "--model.reset_positions_per_document needs the rotary gather, "
                "which Neuron does not support. Drop the flag on Neuron "
                "(block_causal masking works without it)."
            )
        apply_model_options(config.model_spec.model, options)

    def _gradient_clipping(self):
        """torch.compile'd clipping when ``grad_clip`` is a compile component
        (a step hook may swap in its own tracing of the same function), else
        torchtitan's eager one."""
        compile_config = self.config.compile
        self.compiled_clip = None
        if not (compile_config.enable and GRAD_CLIP_COMPONENT in compile_config.components):
            return dist_utils.clip_grad_norm_
        self.compiled_clip = compile_grad_clip(compile_config.backend)
        logger.info("Compiling gradient-norm clipping with torch.compile")
        if self.step_hook.wrap_clip is not None:
            return self.step_hook.wrap_clip(self.compiled_clip)
        return self.compiled_clip

    def _open_hf_doors(self) -> None:
        """The Hugging Face hand-off on export and the tolerant import."""
        checkpointer = self.checkpointer
        if not isinstance(checkpointer, NeuronCheckpointManager) or not checkpointer.enable:
            return
        checkpointer.hf_import_skip = unexpressed_import_skip(
            self.config.model_spec, checkpointer.sd_adapter)
        checkpointer.hf_hand_off = export_hand_off(self)
        checkpointer.adapter_load = adapter_loader(self)

    def post_dataloading_process(self, input_dict, labels):
        if self.parallel_dims.cp_enabled:
            return self._context_parallel_batch(input_dict, labels)
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        options = self.config.model
        block = options.attn_mask_type == "block_causal"
        needed = block or options.reset_positions_per_document
        if not needed and self._documents_noted:
            return inputs, labels, extra_kwargs
        starts = self._document_starts(inputs, block)
        if block:
            extra_kwargs["attention_masks"] = block_causal_mask(starts)
        if options.reset_positions_per_document:
            extra_kwargs["positions"] = document_positions(starts)
        return inputs, labels, extra_kwargs

    def _context_parallel_batch(self, input_dict, labels):
        """Under context parallelism: documents are read from the whole rows,
        torchtitan shards tokens, labels and positions over ``cp``, and the
        mask of this rank's queries against the gathered keys is built here
        (``components/context_parallel.py``)."""
        options = self.config.model
        block = options.attn_mask_type == "block_causal"
        tokens = input_dict["input"]
        batch, seq_len = tokens.shape
        starts = self._document_starts(tokens, block)
        if options.reset_positions_per_document:
            input_dict = {**input_dict, "positions": document_positions(starts)}
        full_positions = input_dict.get("positions")
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        cp_mesh = self.parallel_dims.get_mesh("cp")
        balancer = self.config.parallelism.context_parallel_load_balancer
        cp_degree, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
        if (full_positions is not None and not self._cp_order_checked
                and not is_fake(full_positions)):
            # torchtitan sharded the positions with its balancer: this rank's
            # must be the rows the mask gives its queries. (Real tensors only:
            # the planner's have no values.)
            self._cp_order_checked = True
            queries = rank_positions(token_order(seq_len, cp_degree, balancer),
                                     cp_degree, cp_rank)
            sharded = extra_kwargs["positions"].cpu()
            if not torch.equal(sharded, full_positions.cpu()[:, queries]):
                raise RuntimeError(
                    "context parallelism: torchtitan's sharding of the sequence no "
                    "longer matches token_order() (components/context_parallel.py) "
                    f"on cp rank {cp_rank}; the attention mask would be wrong.")
        extra_kwargs["attention_masks"] = local_attention_mask(
            batch, seq_len, cp_degree, cp_rank, balancer,
            documents=document_ids(starts) if block else None,
            device=inputs.device,
        )
        return inputs, labels, extra_kwargs

    def _document_starts(self, tokens: torch.Tensor, block: bool) -> torch.Tensor:
        """Where each packed document starts; the first batch's are noted once."""
        starts = document_starts(
            tokens, getattr(self.tokenizer, "bos_id", None),
            getattr(self.tokenizer, "eos_id", None),
        )
        if not self._documents_noted:
            self._documents_noted = True
            self._note_documents(starts, block)
        return starts

    def _note_documents(self, starts: torch.Tensor, block: bool) -> None:
        """One line on the first batch's packed documents (none in a traced
        step, whose batch on the neuron branch holds no values)."""
        if not self.step_hook.read_values:
            return
        if block:
            docs = int(starts.sum())
            logger.info(
                f"Block-causal attention: {docs} documents in the first batch "
                f"(mean {starts.numel() / docs:.0f} tokens); no attention "
                "crosses a document boundary."
            )
            return
        share = cross_document_share(starts)
        if share > 0:
            logger.info(
                f"Packed documents under causal attention: {share:.1%} of "
                "the attention pairs in the first batch cross a document "
                "boundary. --model.attn_mask_type block_causal keeps each "
                "document to itself."
            )

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        detached = loss.detach().float()
        if self._step_loss is None:
            self._step_loss = detached.clone()
        else:
            self._step_loss += detached
        return loss

    def _guarded(self, clip):
        """``clip``, then stop if this step's loss or gradient norm is not
        finite: torchtitan's optimizer step comes right after clipping."""

        def clip_then_check(*args, **kwargs):
            grad_norm = clip(*args, **kwargs)
            self._check_finite(grad_norm)
            return grad_norm

        return clip_then_check

    def _check_finite(self, grad_norm: torch.Tensor) -> None:
        local = self._step_loss
        self._step_loss = None
        if local is None or not self.step_hook.read_values:
            return
        # The same reduction torchtitan logs, so every rank sees the same
        # figure and they all stop together (no rank left in a collective).
        if self.parallel_dims.dp_cp_enabled:
            loss = dist_utils.dist_sum(local, self.parallel_dims.get_optional_mesh("loss"))
        else:
            loss = float(local.item())
        norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        bad = [
            f"{name} is {value}"
            for name, value in (("loss", loss), ("gradient norm", norm))
            if not math.isfinite(value)
        ]
        if bad:
            raise NonFiniteError(
                f"Step {self.step}: {' and '.join(bad)} (loss={loss}, "
                f"grad_norm={norm}). Training stopped before the optimizer "
                f"applied step {self.step}'s update; no checkpoint is written for "
                "it, and earlier checkpoints are untouched. Resume from the last "
                "checkpoint with a lower --optimizer.lr or a smaller "
                "--training.max_norm, or check the data of this step."
            )

    def _measured_train_step(self, data_iterator) -> None:
        compile_config = self.config.compile
        if compile_config.enable and compile_config.backend != "aot_eager":
            logger.warning(
                f"{MEASURE_MEMORY_ENV}: the tracker sees the storages made by "
                "ops that pass through the dispatcher; compile backend "
                f"'{compile_config.backend}' allocates some of its buffers "
                "outside it, so part of the step is not counted. Measure with "
                "--compile.backend aot_eager (the same graphs, run op by op)."
            )
        persistent = step_start_state(self)
        process = ProcessPeak.start()
        with self._tracker:
            super().train_step(data_iterator)
        gib = 1024**3
        peak = (sum(persistent.values()) + self._tracker.peak) / gib
        parts = {**persistent, **self._tracker.peak_by_category}
        logger.info(
            f"Measured tensor memory at step {self.step}: measured_peak_gib={peak:.4f} "
            + " ".join(f"{k}={v / gib:.4f}" for k, v in parts.items())
        )
        if process is not None:
            # The allocator's side of the same step, independent of the tracker.
            logger.info(process.describe(sum(persistent.values())))

    def train(self):
        super().train()
        record = getattr(self.metrics_processor, "record", None)  # a user's own has none
        if record is not None and self.step_hook.read_values and run_report.is_rank0():
            summary = run_report.summarize(self.config, record,
                                           self._compile_progress, devices.current().name)
            summary["parameters_trained"], summary["parameters"] = self.trainable_parameters
            run_report.write_summary(self.config, summary)
            logger.info(run_report.describe(summary))

    def _first_compile(self):
        """The compile announcement around this process's first compiled step."""
        if self._compile_progress is not None or not self.config.compile.enable \
                or not self.step_hook.read_values:
            return contextlib.nullcontext()
        neff = os.environ.get(devices.NEFF_CACHE_ENV) if devices.current().is_neuron \
            else None
        self._compile_progress = run_report.CompileProgress(
            self.config.compile.backend, os.environ.get("TORCHINDUCTOR_CACHE_DIR"), neff)
        return self._compile_progress

    def train_step(self, data_iterator):
        with grad_clip_override(self._clip_then_check), self._first_compile():
            if self._tracker is not None and self.step == self._measure_step:
                self._measured_train_step(data_iterator)
            else:
                super().train_step(data_iterator)
        if self.step == 1:
            # After the first step the gradients and optimizer state exist.
            state = sharded_state_bytes(self.model_parts, self.optimizers)
            logger.info(f"Per-rank sharded state: {state.describe()}")


def trainable_parameters(model_parts) -> tuple[int, int]:
    """(parameters that train, all parameters), counted whole (a sharded
    parameter by its global size), over every model part of this rank."""
    params = [p for part in model_parts for p in part.parameters()]
    return (sum(p.numel() for p in params if p.requires_grad),
            sum(p.numel() for p in params))


class NeuronTrainer(NeuronTrainerMixin, Trainer):
    """torchtitan's Trainer with backend resolution and compiled grad clipping."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: ModelOptions = field(default_factory=ModelOptions)

        def _validate_cuda_graphs(self) -> None:
            if cuda_graphs_apply():
                Trainer.Config._validate_cuda_graphs(self)
