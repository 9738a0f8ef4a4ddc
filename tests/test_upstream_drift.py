"""Every patch, wrapper or override of torch or torchtitan notices when upstream moves.

Proves, for each row of docs/upstream-workarounds.md: the upstream code the
row works around is still the code of the pinned versions (torch 2.14.1,
torchtitan 0.3.0), by a hash of its source read from the installed file (so
a patch applied in this process does not hide a change); where the row rests
on a behaviour (a call torch.cpu lacks, an assert, a missing backend), that
behaviour still holds. A failure names the row to revisit. It also checks the
document itself: every row names a drift test that exists, and every row this
file pins is in the document. In-process, no launches; a few seconds.

Tier: fast.

Run: .venv/bin/python -m pytest tests/test_upstream_drift.py -q
"""

import ast
import hashlib
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "upstream-workarounds.md"

# row of docs/upstream-workarounds.md -> upstream definitions it depends on,
# as "module:qualified.name" -> the first 16 hex digits of the sha256 of the
# definition's source in torch 2.14.1 / torchtitan 0.3.0.
PINNED: dict[str, dict[str, str]] = {
    "gloo-one-worker": {
        # Builds the gloo group with the constructor's default of two worker
        # threads per device, which race in ProcessGroupGloo::runLoop.
        "torch.distributed.distributed_c10d:_create_gloo_process_group": "f89272ab847d054a",
        "torch.distributed.distributed_c10d:_register_builtin_gloo_backend": "49fa67e44e86aa34",
    },
    "device-globals": {
        # Falls back to "cuda" when no accelerator is found.
        "torchtitan.tools.utils:get_device_info": "028417d78046c5ed",
    },
    "local-device": {"torchtitan.tools.utils:get_local_device": "a92438941df47aed"},
    "peak-flops": {"torchtitan.tools.utils:get_peak_flops": "d16671707565ac82"},
    "dram-bandwidth": {"torch._inductor.utils:get_gpu_dram_gbps": "c08ded76915e06e1"},
    "compile-workers": {
        # The inductor backend warms a pool of compile_threads workers on its
        # first call, cache hit or not.
        "torch._dynamo.backends.inductor:inductor": "df3246ccd984a1bb",
        "torch._inductor.async_compile:maybe_warm_pool": "641132d1695a72bc",
        "torch._inductor.async_compile:AsyncCompile.warm_pool": "20f20c4e73671af4",
        "torch._inductor.async_compile:get_compile_threads": "829aacdcb35bf28b",
    },
    "compile-cache-per-rank": {
        "torch._functorch._aot_autograd.autograd_cache:autograd_cache_key": "e9d186a949b04845",
    },
    "grad-clip-override": {
        "torchtitan.trainer:Trainer.train_step": "a31b4caeb25d6b40",
        "torchtitan.distributed.utils:clip_grad_norm_": "274e17c85b325b73",
    },
    "trainer-data-path": {
        "torchtitan.trainer:Trainer.post_dataloading_process": "51be1a1136fb496f",
    },
    "trainer-step": {
        "torchtitan.trainer:Trainer.forward_backward_step": "b1f815b9a27e26bd",
        "torchtitan.trainer:Trainer.train_step": "a31b4caeb25d6b40",
        "torchtitan.experiments.graph_trainer.trainer:GraphTrainer.forward_backward_step": "42075c9ebac5d691",
        "torchtitan.experiments.graph_trainer.trainer:GraphTrainer.train_step": "9bce12a187ca10f4",
        "torchtitan.experiments.graph_trainer.trainer:GraphTrainer.close": "0855dd5996560490",
    },
    "metrics-processor": {
        # Every logged step's metrics reach metrics_processor.logger.log, and
        # log prints the step line the suffix goes on.
        "torchtitan.components.metrics:MetricsProcessor.log": "f903b614bb669ad1",
        "torchtitan.components.metrics:MetricsProcessor.__init__": "e95ed9d3aab1e2a7",
        "torchtitan.components.metrics:MetricsProcessor._build_metric_logger": "870781c4ffab68e7",
        "torchtitan.trainer:Trainer.train": "1007394b8f1a6dfb",
    },
    "cuda-graph-notice": {
        # Warns off CUDA and returns the step unchanged.
        "torchtitan.distributed.cudagraph:wrap_with_cuda_graph": "b3310729074690a6",
        # zero_grad(set_to_none=disable_cuda_graphs): why the flag is left alone.
        "torchtitan.trainer:Trainer.train_step": "a31b4caeb25d6b40",
    },
    "step-start-state": {
        # Opens with zero_grad(set_to_none=disable_cuda_graphs), which
        # step_start_state calls first to read the state the step holds.
        "torchtitan.trainer:Trainer.train_step": "a31b4caeb25d6b40",
    },
    "gloo-force-sum": {
        "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_gradient_divide_factors":
            "6ec54eb2f2b5ccc6",
    },
    "jit-only": {
        # Its mode field: aot_fx_trace by default, jit deprecated.
        "torchtitan.experiments.graph_trainer.configs:GraphTrainerCompileConfig": "fec4d9dc0f0be94a",
        "torchtitan.trainer:Trainer.Config.__post_init__": "b1964e81300493a2",
    },
    "atomic-saves": {
        "torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_save": "4688af5aa781414f",
        "torchtitan.components.checkpointer.dcp:CheckpointManager.__init__": "ee2e4ead2d91c00b",
    },
    "layout-invariant-init": {
        "torchtitan.protocols.module:Module._init_param": "1fb50c1893b486ff",
        "torchtitan.protocols.model:BaseModel.init_weights": "f743523760725c0a",
    },
    "reshard-after-forward": {
        "torchtitan.experiments.graph_trainer.simple_fsdp:_register_parametrization":
            "b2aa13e02ff73300",
        # How graph_trainer reads --parallelism.fsdp_reshard_after_forward,
        # which jit mode follows.
        "torchtitan.distributed.fsdp:get_fsdp_reshard_after_forward_policy":
            "20b48b3b02432711",
        "torchtitan.experiments.graph_trainer.memory_policy:_default_memory_policy_pass":
            "9ca0db7761b8a1fa",
    },
    "simple-fsdp-bucketing": {
        "torchtitan.experiments.graph_trainer.simple_fsdp:_register_parametrization":
            "b2aa13e02ff73300",
        "torchtitan.experiments.graph_trainer.simple_fsdp:ReplicateComputation.replicate_compute":
            "c0071e5062e70acb",
        "torchtitan.experiments.graph_trainer.simple_fsdp:ReplicateComputation.forward":
            "3db7f1ac581ae5ae",
        "torchtitan.experiments.graph_trainer.common_utils:apply_simple_fsdp":
            "ac3da2d32b8ace0a",
    },
    "inductor-collective-overlap": {
        # The built-in passes --compile.overlap_collectives names, and the
        # scheduler entry that runs them.
        "torch._inductor.comms:sink_waits": "2cb639af5d38bfc8",
        "torch._inductor.comms:raise_comms": "9229369c603391b1",
        "torch._inductor.comms:reorder_compute_for_overlap": "4f522a862ef08002",
        "torch._inductor.comms:reorder_compute_and_comm_for_overlap": "d9aa38d5f6b2fbfe",
    },
    "inductor-prefetch": {
        # The hook's caller, the cache key that reads it, and the overlap
        # pass inductor runs after it on the scheduler's nodes.
        "torch._inductor.fx_passes.post_grad:post_grad_passes": "44196b5565b62167",
        "torch._inductor.comms:simple_overlap": "81dddf4da1a9036a",
        "torch._inductor.custom_graph_pass:CustomGraphPass": "5e4c77e0cbf0be30",
    },
    "dynamo-side-effects-under-ac": {
        "torch._dynamo.side_effects:SideEffects.check_allowed_side_effect": "2b80bc87546e1d2e",
    },
    "chunked-loss-lm-head-once": {
        # Calls self._gradient_backprop after the chunk loop; lm_head is
        # applied per chunk through its getter.
        "torchtitan.components.loss:ChunkedLossWrapper.__call__": "658be72da53d45c9",
        # Reads each lm_head parameter's sharded .grad.
        "torchtitan.experiments.graph_trainer.chunked_loss:ChunkedLossWrapperWithParamGrads._gradient_backprop":
            "103799e0609844e2",
        # Called here with the lm_head parameters that train: its forward reads
        # the .grad of each parameter it is given.
        "torchtitan.experiments.graph_trainer.chunked_loss:_ChunkedLossWrapperWithParamGrads.forward":
            "2fdd5cc626c02ddb",
        # Turns the recipes' ChunkedLossWrapper into ChunkedLossWrapperWithParamGrads.
        "torchtitan.experiments.graph_trainer.configs:to_graph_trainer_config": "43deed158820596a",
    },
    "autograd-function-cache": {
        # A custom autograd.Function's HOP is cacheable only under the flag.
        "torch._ops:HigherOrderOperator.cacheable": "4ae0f70b25472218",
        "torch._inductor.codecache:CacheabilityValidator.validate_graph": "d6903426ae0ca418",
        "torch._functorch._aot_autograd.autograd_cache:check_node_safe": "e6415b74ffb93cf5",
    },
    "sac-cache-hash": {
        "torch._functorch._aot_autograd.autograd_cache:_get_context_fn_cache_hash":
            "155b120eea3284a2",
    },
    "jit-parallelize": {
        "torchtitan.experiments.graph_trainer.llama3.parallelize:parallelize_llama":
            "a54fc2918cc4a730",
        "torchtitan.experiments.graph_trainer.deepseek_v3.parallelize:parallelize_deepseekv3":
            "abacee49757594d6",
    },
    "jit-memory-policy": {
        "torchtitan.distributed.activation_checkpoint:SelectiveAC._wrap_block":
            "3e0f0cc84f7bebd2",
        "torchtitan.experiments.graph_trainer.memory_policy:_make_default_memory_policy":
            "f01382881844911d",
        "torchtitan.experiments.graph_trainer.configs:GraphTrainerCompileConfig":
            "fec4d9dc0f0be94a",
    },
    "keep-base-ac": {
        "torchtitan.experiments.graph_trainer.configs:to_graph_trainer_config": "43deed158820596a",
    },
    "layout-invariant-loader": {
        "torchtitan.hf_datasets.text_datasets:HuggingFaceTextDataset.__iter__": "e9fc76d957ab13ad",
        "torchtitan.hf_datasets.text_datasets:_validate_dataset": "de105a6a433cc0e3",
    },
    "count-once-moe": {
        "torchtitan.models.common.moe:MoE.forward": "3b1ec5469987c823",
        "torchtitan.models.common.moe:MoE._init_self_buffers": "4c4a0ecd4e505785",
        "torchtitan.components.optimizer.optimizer:register_moe_load_balancing_hook":
            "c7a067786f9a455e",
    },
    "expert-kernel": {
        "torchtitan.models.common.moe:GroupedExperts.forward": "a964d794b212d5a7",
        "torchtitan.models.common.moe:GroupedExperts._grouped_mm": "ca33a9db4455b6d7",
    },
    "gpt-oss-experts-dtype": {
        # The forward replaced (its .bfloat16() casts), the parameters kept,
        # and the SwiGLU and TP bias scaling reused as they are.
        "torchtitan.models.gpt_oss.moe:GptOssGroupedExperts.forward": "3891bc0190d95330",
        "torchtitan.models.gpt_oss.moe:GptOssGroupedExperts.__init__": "3988a6f3710fd308",
        "torchtitan.models.gpt_oss.moe:swiglu": "d0cdd327acd4d182",
        "torchtitan.models.gpt_oss.moe:ScaleBiasForward": "b68c6f0a24883927",
    },
    "gpt-oss-spec": {
        # Its parallelize, pipelining and state-dict adapter are kept; its
        # load-balancing hook and Flex/varlen attention are replaced.
        "torchtitan.models.gpt_oss:model_registry": "7d6d8239af158241",
        "torchtitan.models.gpt_oss.model:GptOssModel.get_attention_masks": "4ba8b2d8fd2814bc",
    },
    "gpt-oss-graph-model": {
        # The DeepSeek-V3 GraphTrainer pieces copied for GPT-OSS.
        "torchtitan.experiments.graph_trainer.deepseek_v3.model:GraphTrainerDeepSeekV3Model.init_states":
            "46e19c97aff8f51e",
        "torchtitan.experiments.graph_trainer.deepseek_v3.parallelize:annotate_deepseekv3":
            "5e4ca6f500e4c3bf",
    },
    "gpt-oss-hf-adapter": {
        # The map whose expert entries are popped, and the conversions run
        # for every other key.
        "torchtitan.models.gpt_oss.state_dict_adapter:GptOssStateDictAdapter.__init__":
            "bc442c794ef7ae3d",
        "torchtitan.models.gpt_oss.state_dict_adapter:GptOssStateDictAdapter.to_hf":
            "661eba4853e9938b",
        "torchtitan.models.gpt_oss.state_dict_adapter:GptOssStateDictAdapter.from_hf":
            "87ea55bf2025b18e",
    },
    "hf-import-unexpressed": {
        # Asks DCP for every key to_hf names when loading an HF folder.
        "torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_load": "232eddc0682d2e11",
    },
    "hf-export-hand-off": {
        # The last-step HF export goes through dcp_save with to_hf=True.
        "torchtitan.components.checkpointer.dcp:CheckpointManager._save_last_step":
            "953f4e9dbd51471a",
        "torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_save": "4688af5aa781414f",
    },
    "pp-jit-stages": {
        "torchtitan.experiments.graph_trainer.graph_pp.pipeline:_validate_graph_pp_config":
            "6a6a47dd5d8985ad",
        # The stage split used per stage, and the arithmetic the preflight runs.
        "torchtitan.distributed.pipeline_parallel:pipeline_llm":
            "012e34344a8e25fd",
        "torchtitan.distributed.pipeline_parallel:_get_pipeline_metadata":
            "9e89ee9aa512b8a7",
        "torchtitan.distributed.pipeline_parallel:_generate_llm_fqn_per_model_part":
            "a18d710d17e556df",
    },
    "held-out-validation": {
        # The default replaced, and the copy that sets infinite by --validator.steps.
        "torchtitan.components.validate:Validator.Config": "68a6a6bc57271ed7",
        "torchtitan.components.validate:Validator.__init__": "f709ccbe93e3597c",
    },
    "validator-trainer-batches": {
        "torchtitan.components.validate:Validator.post_dataloading_process":
            "43848f8c9c22d579",
    },
    "chat-packing": {
        # The prompt masking followed by PackedTextStream._chat_pair.
        "torchtitan.hf_datasets.text_datasets:ChatDataset._tokenize_sample": "4af7a42897ca1ef8",
    },
    "lora-refreeze": {
        # Re-registers each parameter as nn.Parameter(...): requires_grad True.
        "torchtitan.experiments.graph_trainer.simple_fsdp:data_parallel": "d656ea9b077c34c0",
        # Frozen config subclasses around every non-target module.
        "torchtitan.components.lora:LoRAConverter.convert": "44e0e02fbf6092a1",
    },
    "lora-peft-adapter": {
        # The fused q/k/v rows: the export splits lora_B, the import joins it.
        "torchtitan.models.common.attention:FusedQKVLinear._split_qkv_on_save":
            "97a39b1c0736260b",
        "torchtitan.models.common.attention:FusedQKVLinear._merge_qkv_on_load":
            "9bd4f125fc556b31",
        # The adapters' names (lora_a, lora_b) and the scaling alpha / rank.
        "torchtitan.components.lora:_get_lora_cls": "dc4c1d4fcb5c7849",
    },
    "plan-pp-static-stages": {
        # Builds each stage without shapes; the module-level name is patched.
        "torchtitan.distributed.pipeline_parallel:_pipeline_module_split": "ad12cfa9e56712b5",
        # Where the last stage sits (tracing/world.py last_stage_rank): on the
        # last pipeline rank, or rank 0 for the V schedules.
        "torchtitan.distributed.pipeline_parallel:_get_pp_rank_to_stage_indices_mapping":
            "c2c848701484dc33",
        # Static shapes given at construction, and when a stage still needs
        # the dynamic agreement.
        "torch.distributed.pipelining.stage:PipelineStage.__init__": "59c5343707f9572b",
        "torch.distributed.pipelining._utils:InferenceMode.needs_dynamic": "7589afc77f860d15",
        # The vote replaced on a traced rank's schedule, and its own fake branch.
        "torch.distributed.pipelining.schedules:_PipelineSchedule._warmup_p2p":
            "d97c30d4e2406cbc",
    },
    "rehearse-tensor-on-device": {
        # Returns torch.tensor([-1.0], device=...) on ranks without the last stage.
        "torchtitan.trainer:Trainer.pp_forward_backward_step": "29a6284a9ec37e25",
    },
    "cuda-graphs-off-cuda": {
        "torchtitan.trainer:Trainer.Config._validate_cuda_graphs": "82fa664ba0b27468",
    },
    "cp-allgather-sdpa": {
        # The CP wrapper replaced, and the sharding whose order the mask follows.
        "torchtitan.distributed.context_parallel.api:apply_cp_to_forward": "c4287c786ba9acd7",
        "torchtitan.experiments.graph_trainer.common_utils:apply_cp_to_attention":
            "3136eb40351807e9",
        "torchtitan.distributed.context_parallel.api:cp_shard": "d8ed6eb6930ced2d",
        "torch.distributed.tensor.experimental._context_parallel._load_balancer:"
        "_HeadTailLoadBalancer._generate_indices": "251eda0ebe3bc865",
    },
    "gpt-oss-rowwise-bias-grad": {
        "torchtitan.models.common.linear:ScaledBiasRowwiseLinear.forward": "74254752a2af4095",
    },
    "ep-experts-before-ac": {
        "torchtitan.experiments.graph_trainer.common_utils:apply_simple_fsdp": "ac3da2d32b8ace0a",
    },
    "simple-fsdp-uneven-tp": {
        # The gather that re-wraps the FSDP shard with from_local (the wrong
        # size when uneven), the loop body copied for one module, the private
        # pieces called, and the wrapper that skips modules wrapped first.
        "torchtitan.experiments.graph_trainer.simple_fsdp:ReplicateComputation.replicate_compute":
            "c0071e5062e70acb",
        "torchtitan.experiments.graph_trainer.simple_fsdp:data_parallel": "d656ea9b077c34c0",
        "torchtitan.experiments.graph_trainer.simple_fsdp:_distribute_dtensor":
            "6653a6729b8614ea",
        "torchtitan.experiments.graph_trainer.simple_fsdp:_register_parametrization":
            "b2aa13e02ff73300",
        "torchtitan.experiments.graph_trainer.common_utils:apply_simple_fsdp":
            "ac3da2d32b8ace0a",
    },
    "prefix-cache-rope": {"torchtitan.models.common.rope:RoPE.forward": "9856f0d4c06a2b78"},
    "real-rope": {
        # The cache and the rotation it replaces, and upstream's code it still runs.
        "torchtitan.models.common.rope:ComplexRoPE._precompute_cache": "4ab07456449f56a4",
        "torchtitan.models.common.rope:ComplexRoPE._reshape_cache": "b854af3cfd65b3c4",
        "torchtitan.models.common.rope:ComplexRoPE.apply_rotary_emb": "d97ad68ff433f6b1",
        "torchtitan.models.common.rope:RoPE.__init__": "dbaa2b227dfb9f54",
        "torchtitan.models.common.rope:RoPE._init_self_buffers": "e92f59a8ed250f79",
        "torchtitan.models.common.rope:_reshape_for_broadcast": "def978489d4e0b13",
        "torchtitan.models.common.rope:_maybe_wrap_positions": "a2af8d38d867048a",
        "torchtitan.models.common.rope:_maybe_check_max_pos": "3a5325f977a8850f",
    },
    "sdpa-sink-attention": {
        # The forward whose inner call SdpaSinkAttention.forward replaces, the
        # sink rescale it computes as an extra key, the parameters and scale
        # it keeps, and the local_map TP wraps inner_attention in.
        "torchtitan.models.gpt_oss.model:Attention.forward": "393a1a1f38d53631",
        "torchtitan.models.gpt_oss.model:Attention.__init__": "ae28c712a17a1fc2",
        "torchtitan.models.gpt_oss.model:Attention._apply_sinks": "1649838cd57accb1",
        "torchtitan.models.gpt_oss.model:apply_attention_sink_rescale": "ddd03030970c4677",
        "torchtitan.models.common.decoder_sharding:set_gqa_inner_attention_local_map":
            "f22409dd9d11c299",
        # Masks are built only for Flex / varlen inner attention.
        "torchtitan.trainer:Trainer.post_dataloading_process": "51be1a1136fb496f",
        "torchtitan.components.validate:Validator.post_dataloading_process": "43848f8c9c22d579",
    },
    "sdpa-sink-model": {
        # The forward SdpaSinkGptOssModel.forward copies (plus the masks), the
        # block that picks attention_masks[attn_mask_key] from a dict, and the
        # keys and window choice of upstream's own masks.
        "torchtitan.models.common.decoder:Decoder.forward": "58c16714d1cc42b6",
        "torchtitan.models.gpt_oss.model:GptOssTransformerBlock.__init__": "9e87826bf89f2533",
        "torchtitan.models.gpt_oss.model:GptOssTransformerBlock.forward": "49130908bf05decc",
        "torchtitan.models.gpt_oss.model:GptOssModel.get_attention_masks": "4ba8b2d8fd2814bc",
    },
    "block-causal": {
        "torchtitan.models.common.attention:ScaledDotProductAttention.forward":
            "1b4f80db0606060f",
    },
    "sdpa-for-lms": {
        "torchtitan.models.common.config_utils:get_attention_config": "ccb7e1e5fad5850b",
    },
    "recipe-import-errors": {
        "torchtitan.config.manager:ConfigManager._load_config": "b96fe64ba9a092b0",
    },
    "layout-checks": {
        "torchtitan.distributed.parallel_dims:ParallelDims._validate": "f61f87876767b792",
        "torchtitan.distributed.parallel_dims:ParallelDims.seq_len_divisor": "bd905a57d3201f66",
    },
    "torchrun-wrapper": {
        "torch.distributed.run:run": "6c6f923a0c2ca410",
        "torch.distributed.elastic.multiprocessing.errors:ChildFailedError.get_first_failure":
            "22cf01495552e5fa",
    },
    "train-entry": {"torchtitan.train:main": "68b900e7f64a3d85"},
    "measured-memory-loss": {
        "torchtitan.trainer:Trainer.forward_backward_step": "b1f815b9a27e26bd",
    },
    # The memory planner (torchtitan_neuron/plan/).
    "plan-fake-init": {"torchtitan.protocols.module:Module._init_param": "1fb50c1893b486ff"},
    "plan-fake-buffers": {
        "torchtitan.protocols.model:BaseModel.init_weights": "f743523760725c0a",
    },
    "plan-fake-to-empty": {"torch.nn.modules.module:Module.to_empty": "ccee5059ff9c0a9b"},
    "plan-joint-graph-text": {
        "torch._functorch._aot_autograd.graph_compile:_log_joint_graph": "9312a2e731d4e8d4",
    },
    "plan-fw-bw-graph-text": {
        "torch._functorch._aot_autograd.graph_compile:_log_fw_bw_graphs": "b70cf72fc73b475a",
    },
    "plan-sac-detach": {"torch.utils.checkpoint:_detach_helper": "27afb262e06c34c5"},
    "plan-ep-splits": {
        # Reads the exchanged token counts back with .tolist(); FakeTensors have none.
        "torchtitan.models.common.token_dispatcher:"
        "AllToAllTokenDispatcher._sync_token_count_exchange": "6df451b24ec72516",
        # Its (N, D) rows, sent by the dispatch all-to-all: N = tokens x top_k.
        "torchtitan.models.common.token_dispatcher:"
        "LocalTokenDispatcher._local_reorder": "bc94633dc919e9dd",
        # Takes the (tokens, dim) input first, reorders it by _local_reorder,
        # then sizes the all-to-all and _permute from the splits.
        "torchtitan.models.common.token_dispatcher:"
        "AllToAllTokenDispatcher.dispatch": "d029017945502c06",
    },
    "cpu-attention-sac": {
        "torchtitan.distributed.activation_checkpoint:SelectiveAC.get_save_ops":
            "d33eba0127fe72d8",
    },
    "quiet-metrics": {
        "torchtitan.components.metrics:MetricsProcessor.should_log": "7a699ad8ece353f5",
        "torchtitan.trainer:Trainer.train_step": "a31b4caeb25d6b40",
    },
    "plan-traced-clip": {"torchtitan.distributed.utils:clip_grad_norm_": "274e17c85b325b73"},
    # The neuron branch's device module (devices/neuron.py) and the rehearsal
    # (torchtitan_neuron/rehearse/).
    "neuron-device-module": {
        "torchtitan.tools.utils:get_device_info": "028417d78046c5ed",
        "torchtitan.components.metrics:DeviceMemoryMonitor.get_peak_stats": "eda5f044a9f92205",
    },
    "rehearse-device": {
        "torch.utils.backend_registration:_setup_privateuseone_for_python_backend":
            "d717d7b4fcf5626e",
    },
    "rehearse-fused-sdpa": {
        "torch._meta_registrations:meta__scaled_dot_product_fused_attention_overrideable":
            "162b3defce2152a0",
        "torch._meta_registrations:"
        "meta__scaled_dot_product_fused_attention_overrideable_backward": "a58a52fe021beaba",
    },
    "rehearse-process-group": {
        "torch.testing._internal.distributed.fake_pg:_create_fake_pg": "9f06d0f58a476e60",
        "torchtitan.distributed.utils:init_fake_mode": "258a62002f60fdf6",
        "torchtitan.distributed.utils:init_distributed": "49182e2c01f50b5e",
    },
    "rehearse-graph-break-record": {
        "torch._dynamo.output_graph:GraphCompileReason": "4c66dbce75307a51",
        "torch._dynamo.exc:Unsupported": "9acc8ad0513f04fd",
    },
    "bench-aot-fx-trace-no-dedup": {
        # Merges every gather chain of one parameter into the first; a chain
        # ends after the ops that follow its wait, casts included.
        "torchtitan.experiments.graph_trainer.fsdp_passes:"
        "deduplicate_fsdp_unshard_chains_pass": "443c00d53a9d4f83",
        "torchtitan.experiments.graph_trainer.fsdp_patterns:"
        "_find_last_user_in_wait_chain": "93937da7a827af1a",
        # The experts cast the gathered fp32 weights to bf16 for grouped_mm.
        "torchtitan.models.common.moe:GroupedExperts.forward": "a964d794b212d5a7",
    },
    "bench-peers-same-work": {
        # SeededGraphTrainer wraps it in the layout-invariant initialisation.
        "torchtitan.experiments.graph_trainer.trainer:GraphTrainer.__init__": "22c610927e5d368a",
        # aot_fx_trace's eager graph policy saves what this list names.
        "torchtitan.distributed.activation_checkpoint:_get_default_save_ops": "c82c91696777ccfa",
        "torchtitan.experiments.graph_trainer.memory_policy:_make_eager_memory_policy":
            "7fb262b95f6a29ee",
    },
}


def upstream_source(target: str) -> str:
    """The source of ``module:qualified.name`` as the installed file has it.

    Read from the file, not the live attribute: devices.install() and the
    trainer replace some of these attributes in this process.
    """
    module_name, qualname = target.split(":")
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    node = tree
    for part in qualname.split("."):
        node = next(
            (n for n in node.body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             and n.name == part),
            None,
        )
        if node is None:
            raise LookupError(f"{target}: no definition {part!r} in {module_name}")
    return ast.unparse(node)


def source_hash(target: str) -> str:
    return hashlib.sha256(upstream_source(target).encode()).hexdigest()[:16]


_PAIRS = [(row, target, pinned) for row, targets in PINNED.items()
          for target, pinned in targets.items()]


@pytest.mark.parametrize("row, target, pinned", _PAIRS,
                         ids=[f"{row}-{t.split(':')[1]}" for row, t, _ in _PAIRS])
def test_upstream_source_is_the_pinned_one(row, target, pinned):
    try:
        found = source_hash(target)
    except (ImportError, LookupError) as exc:
        pytest.fail(f"{target} is gone ({exc}): revisit row `{row}` of "
                    "docs/upstream-workarounds.md")
    assert found == pinned, (
        f"{target} changed upstream (source hash {found}, pinned {pinned} for "
        f"torch 2.14.1 / torchtitan 0.3.0): revisit row `{row}` of "
        "docs/upstream-workarounds.md, then record the new hash here."
    )


def test_torch_cpu_still_lacks_what_the_cpu_device_module_adds():
    """Row `cpu-device-module`."""
    from torchtitan_neuron import devices

    grown = [n for n in devices.cpu.ADDED_TO_TORCH_CPU if hasattr(torch.cpu, n)]
    assert not grown, (
        f"torch.cpu now has {grown}: take them from torch.cpu (TORCH_CPU_DELEGATES) "
        "and revisit row `cpu-device-module` of docs/upstream-workarounds.md")
    gone = [n for n in devices.cpu.TORCH_CPU_DELEGATES if not hasattr(torch.cpu, n)]
    assert not gone, f"torch.cpu lost {gone}: revisit row `cpu-device-module`"
    assert torch.cpu.current_device() == "cpu", (
        "torch.cpu.current_device() no longer returns 'cpu': revisit row "
        "`cpu-device-module` (CpuDeviceModule.current_device returns an index)")


def test_inductor_copies_of_dram_bandwidth_are_the_ones_patched():
    """Row `dram-bandwidth`: the modules that import get_gpu_dram_gbps by
    name are exactly those devices.install() rebinds."""
    patched = {"torch._inductor.utils", "torch._inductor.scheduler",
               "torch.utils._runtime_estimation"}
    root = Path(torch.__file__).parent
    found = {"torch._inductor.utils"}
    for sub in ("_inductor", "utils"):
        for path in (root / sub).rglob("*.py"):
            text = path.read_text(errors="replace")
            if "get_gpu_dram_gbps" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and any(
                        a.name == "get_gpu_dram_gbps" for a in node.names):
                    rel = path.relative_to(root.parent).with_suffix("")
                    found.add(".".join(rel.parts))
    assert found == patched, (
        f"modules importing get_gpu_dram_gbps by name: {sorted(found)}; "
        "revisit row `dram-bandwidth` of docs/upstream-workarounds.md")


def test_one_compile_thread_starts_no_worker_pool():
    """Row `compile-workers`: one compile thread means no worker processes,
    so a CPU rank's share of the cores bounds what its compile starts."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        before = set(async_compile._pool_set)
        async_compile.maybe_warm_pool()
        assert set(async_compile._pool_set) == before, (
            "inductor started compile workers with compile_threads=1: revisit row "
            "`compile-workers` of docs/upstream-workarounds.md")
        assert not async_compile.AsyncCompile.use_process_pool()


def test_neuron_is_no_compile_backend_without_torch_neuronx():
    """Row `neuron-backend`: off Trainium torch.compile has no "neuron"."""
    import importlib.util

    if importlib.util.find_spec("torch_neuronx") is not None:
        pytest.skip("torch-neuronx is installed: neuron is a real backend here")
    from torch._dynamo import list_backends

    assert "neuron" not in list_backends(exclude_tags=()), (
        "torch.compile now knows a 'neuron' backend without torch-neuronx: "
        "revisit row `neuron-backend` of docs/upstream-workarounds.md")


def test_traced_grouped_mm_still_refuses_fp32():
    """Row `gpt-oss-experts-dtype`: why fp32 GPT-OSS GEMMs take the loop."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(16, 8), torch.empty(2, 8, 16)
        offs = torch.tensor([8, 16], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="BFloat16"):
            torch._grouped_mm(a, b, offs=offs)
        assert torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs).shape == (16, 16)


def test_dedup_pass_still_merges_gathers_of_different_dtypes():
    """Row `bench-aot-fx-trace-no-dedup`: why upstream's aot_fx_trace fails on
    the fp32 DeepSeek model. Two gathers of one parameter, one read as it is
    and one cast to bf16 (what GroupedExperts.forward does), become one: the
    bf16 reader is handed the fp32 value."""
    import torch.fx as fx
    from torchtitan.experiments.graph_trainer.fsdp_passes import (
        deduplicate_fsdp_unshard_chains_pass,
    )

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    graph = fx.Graph()
    shard, x = graph.placeholder("shard"), graph.placeholder("x")
    gathered = []
    for _ in range(2):
        launched = graph.call_function(c10d.all_gather_into_tensor.default, (shard, 2, "0"))
        gathered.append(graph.call_function(c10d.wait_tensor.default, (launched,)))
    as_is = graph.call_function(aten.mm.default, (x, gathered[0]))
    cast = graph.call_function(aten._to_copy.default, (gathered[1],),
                               {"dtype": torch.bfloat16})
    x_bf16 = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    in_bf16 = graph.call_function(aten.mm.default, (x_bf16, cast))
    graph.output((as_is, in_bf16))
    gm = deduplicate_fsdp_unshard_chains_pass(fx.GraphModule(torch.nn.Module(), graph))

    assert in_bf16.args[1] is gathered[0], (
        "upstream's dedup pass no longer hands the bf16 reader the fp32 gather: "
        "try aot_fx_trace on DeepSeek without --compile.disable_passes and revisit "
        "row `bench-aot-fx-trace-no-dedup` of docs/upstream-workarounds.md")
    assert cast not in gm.graph.nodes


def test_torch_tensor_on_a_device_is_still_built_below_the_dispatch_modes():
    """Row `rehearse-tensor-on-device`: a dispatch mode never sees
    ``torch.tensor(data, device=...)``, so the rehearsal's ``HostToFakeDevice``
    cannot make it fake; ``TensorOnDevice`` (a function mode) reroutes it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        torch.tensor([1.0], device="meta")
    assert not seen.ops, (
        "torch.tensor(..., device=) now dispatches through the modes: "
        "rehearse/neuron_device.py TensorOnDevice can go (row `rehearse-tensor-on-device`)")


def test_torchs_gloo_group_still_runs_two_worker_threads():
    """Row `gloo-one-worker`: torch's own gloo group has the two workers that
    race; the project's creator gives one, with the same timeout."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        _create_gloo_process_group, _DistributedBackendOptions)

    from torchtitan_neuron.devices.gloo import create_process_group

    opts = _DistributedBackendOptions()
    opts.store, opts.group_rank, opts.group_size = dist.HashStore(), 0, 1
    opts.timeout, opts.group_id, opts.global_ranks_in_group = timedelta(seconds=77), "g", [0]
    assert _create_gloo_process_group(opts, None).options._threads == 2
    ours = create_process_group(opts)
    assert ours.options._threads == 1 and ours.options._timeout == timedelta(seconds=77)
    assert ours.options.group_name == "g" and ours.options.global_ranks_in_group == [0]


def test_gloo_has_no_premul_sum():
    """Row `gloo-force-sum`: the reason FSDP must sum then scale on gloo."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    assert hasattr(FSDPModule, "set_force_sum_reduction_for_comms")
    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1)
    tensor = torch.ones(2)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist._make_nccl_premul_sum(0.5)
    with pytest.raises(RuntimeError, match="PREMUL_SUM"):
        group.reduce_scatter([tensor], [[torch.ones(2)]], opts).wait()


# ---------------------------------------------------------------------------
# The document and this file agree.

_TEST_REF = re.compile(r"tests/(test_\w+\.py)::(test_\w+)")


def _rows() -> list[str]:
    return [line for line in DOC.read_text().splitlines()
            if line.startswith("|") and not line.startswith(("| File", "|---", "| ---"))]


def test_every_row_names_a_drift_test_that_exists():
    tests = Path(__file__).resolve().parent
    assert _rows(), f"{DOC} has no rows"
    for row in _rows():
        refs = _TEST_REF.findall(row)
        assert refs, f"a row of {DOC.name} names no test (tests/file.py::test_name): {row[:80]}"
        for filename, name in refs:
            path = tests / filename
            assert path.is_file() and re.search(
                rf"^def {name}\b", path.read_text(), re.M), (
                f"{DOC.name} names {filename}::{name}, which does not exist")


def test_every_pinned_row_is_in_the_document():
    text = DOC.read_text()
    missing = [row for row in [*PINNED, "cpu-device-module", "neuron-backend"]
               if f"`{row}`" not in text]
    assert not missing, f"rows pinned here but not in {DOC.name}: {missing}"


def test_aot_fx_traces_save_list_still_lacks_cpu_attention():
    """Row `bench-peers-same-work`: under selective AC `aot_fx_trace`
    recomputes CPU attention, which the other cells save, so the bench prints
    no ratio against it there."""
    from torchtitan.distributed.activation_checkpoint import _get_default_save_ops

    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert cpu_flash not in _get_default_save_ops(), (
        "torchtitan's save list now holds CPU attention: aot_fx_trace's selective "
        "policy does the same work as the others; revisit row `bench-peers-same-work` "
        "(scripts/bench.py comparable())")
