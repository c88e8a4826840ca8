"""Megatron-core's own GPTModel for one stage of a plan, built through its public seams."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetu_ext.config import TrainingConfig
from hetu_ext.plan import ModelSpec


@dataclass(frozen=True, kw_only=True)
class TrainingNumerics:
    """Numerical settings shared by every stage (Megatron-LM flag names in the docstrings)."""

    bf16: bool = False
    """``--bf16``: bf16 parameters and activations with fp32 master weights in the optimizer."""
    fp16: bool = False
    """``--fp16``: fp16 parameters and activations with fp32 master weights in the optimizer, the loss scaled by
    Megatron's grad scaler (exclusive with ``bf16``)."""
    hidden_dropout: float = 0.1
    """``--hidden-dropout``."""
    attention_dropout: float = 0.1
    """``--attention-dropout``."""
    init_method_std: float = 0.02
    """``--init-method-std``."""
    variable_seq_lengths: bool = False
    """Microbatches differ in length (``--hetu-packing``: THD packs); pipeline stages exchange shapes first."""
    recompute_granularity: str | None = None
    """``--recompute-granularity`` (full, selective) and the three below: Megatron-core's own recomputation."""
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None
    sequence_parallel: bool = False
    """``--sequence-parallel``: in stages of TP > 1, norms and dropout see 1/TP of the sequence."""
    zero_centered_gamma: bool = False
    """``--apply-layernorm-1p``: every norm's weight is stored as gamma - 1 (initialised to 0) and scales by
    1 + weight (Megatron's ``layernorm_zero_centered_gamma``)."""
    attention: str = "sdpa"
    """``--hetu-attention``: the stages' core attention (:data:`hetu_ext.megatron.attention.CORE_ATTENTIONS`):
    ``sdpa`` never materialises the scores, ``megatron`` is the local spec's DotProductAttention."""
    compile_layers: bool = False
    """``--hetu-compile``: ``torch.compile`` each transformer layer (norms, SwiGLU, RoPE and the residuals fused by
    inductor); on CUDA only (:func:`compile_layers`)."""
    transformer_impl: str = "local"
    """``--transformer-impl``: Megatron-core's local layer spec or its Transformer Engine spec
    (:mod:`hetu_ext.megatron.layer_spec`)."""
    loss_chunk_tokens: int | str = "auto"
    """``--hetu-loss-chunk-tokens``: the output layer and cross entropy over chunks of this many tokens of the
    rank's sequence, each recomputed in backward (:mod:`hetu_ext.megatron.chunked_loss`); 0: the whole
    microbatch at once (Megatron's); ``auto``: chunks only where a microbatch's fp32 logits exceed 1 GiB."""
    grad_reduce_in_fp32: bool = True
    """Megatron-LM's default under ``--bf16``: DDP's gradient buffers (accumulation and data-parallel reduction)
    in fp32; ``--grad-reduce-in-bf16`` sets it False (buffers in the bf16 parameters' dtype). Under ``--fp16``
    False, as Megatron-LM (``--accumulate-allreduce-grads-in-fp32`` is off by default): fp16 buffers, whose
    overflow the loss scaler detects."""

    @classmethod
    def of(cls, model, training, *, variable_seq_lengths: bool, sequence_parallel: bool = False
           ) -> "TrainingNumerics":
        """From the run's model and training settings (hetu_ext.config's ModelConfig and TrainingConfig)."""
        from .chunked_loss import parse_loss_chunk

        return cls(bf16=training.bf16, fp16=training.fp16, hidden_dropout=model.hidden_dropout,
                   attention_dropout=model.attention_dropout,
                   init_method_std=model.init_method_std, variable_seq_lengths=variable_seq_lengths,
                   sequence_parallel=sequence_parallel, zero_centered_gamma=model.apply_layernorm_1p,
                   grad_reduce_in_fp32=not (training.grad_reduce_in_bf16 or training.fp16),
                   recompute_granularity=model.recompute_granularity, recompute_method=model.recompute_method,
                   recompute_num_layers=model.recompute_num_layers,
                   recompute_modules=tuple(model.recompute_modules) if model.recompute_modules else None,
                   attention=model.attention, compile_layers=model.compile,
                   transformer_impl=model.transformer_impl,
                   loss_chunk_tokens=parse_loss_chunk(model.loss_chunk_tokens))

    def __post_init__(self) -> None:
        assert not (self.bf16 and self.fp16), "--bf16 and --fp16 are exclusive (TrainingConfig checks it)"

    @property
    def half(self) -> bool:
        """bf16 or fp16 parameters: Megatron's Float16Module, fp32 master weights in the optimizer."""
        return self.bf16 or self.fp16

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


def transformer_config(spec: ModelSpec, numerics: TrainingNumerics, *, tp: int, pp: int, on_cpu: bool, cp: int = 1):
    """The TransformerConfig of a stage: Megatron's fused CUDA kernels off on CPU, per-token loss always; ``cp``:
    the stage's context-parallel degree (RoPE's sequence length counts every CP rank's chunks)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    no_fusion = dict(gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
                     persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False) if on_cpu else {}
    config = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels, normalization=spec.normalization, layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=spec.swiglu, activation_func=F.silu if spec.swiglu else F.gelu,
        add_bias_linear=spec.add_bias_linear, add_qkv_bias=spec.add_qkv_bias, qk_layernorm=spec.qk_layernorm,
        layernorm_zero_centered_gamma=numerics.zero_centered_gamma,
        tensor_model_parallel_size=tp, sequence_parallel=numerics.sequence_parallel and tp > 1,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp, pipeline_dtype=numerics.dtype, params_dtype=numerics.dtype,
        bf16=numerics.bf16, fp16=numerics.fp16, hidden_dropout=numerics.hidden_dropout,
        attention_dropout=numerics.attention_dropout,
        init_method_std=numerics.init_method_std,
        # hetu_ext overwrites the weights with its layout-independent values (weights.py), but Megatron's own
        # initialisation must run: with perform_initialization=False 0.16.1 never marks TP-split weights as
        # tensor_model_parallel, and the global grad norm then counts one TP shard only. The "GPU" path
        # initialises only the local shard (the CPU path builds every full weight on every rank).
        use_cpu_initialization=False, perform_initialization=True,
        # the loss is a sum over tokens, normalised once by the global batch's token count
        calculate_per_token_loss=True,
        # the fused vocab-parallel cross entropy takes its TP group from pg_collection (the unfused one reads
        # parallel_state's); "native" is its pure-torch implementation, which runs on CPU too
        cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native",
        variable_seq_lengths=numerics.variable_seq_lengths, transformer_impl=numerics.transformer_impl,
        recompute_granularity=numerics.recompute_granularity, recompute_method=numerics.recompute_method,
        recompute_num_layers=numerics.recompute_num_layers,
        **({"recompute_modules": list(numerics.recompute_modules)} if numerics.recompute_modules else {}),
        # no MoE here, but 0.16.1 refuses variable lengths with its default (allgather) token dispatcher
        **({"moe_token_dispatcher_type": "alltoall"} if numerics.variable_seq_lengths else {}),
        **no_fusion,
    )
    # hetu_ext's own choices travel with the config to build_gpt_stage (callers pass the config, not numerics)
    config.hetu_attention = numerics.attention
    config.hetu_compile = numerics.compile_layers
    config.hetu_loss_chunk_tokens = numerics.loss_chunk_tokens
    config.hetu_transformer_impl = numerics.transformer_impl  # Megatron's own field defaults to transformer_engine
    return config


def build_gpt_stage(spec: ModelSpec, config, *, pre_process: bool, post_process: bool, pg_collection=None,
                    converter=None, layer_offset: int = 0):
    """Megatron-core's GPTModel holding this rank's layers (the layer range comes from Megatron's layout).

    ``converter`` (a model converter, e.g. hetu_ext.lora.install.LoRAConverter): ``converter.layer_spec(spec)``
    transforms the transformer-layer spec before the model is built (Megatron's ModuleSpec seam), then
    ``converter.convert(model, layer_offset=...)`` adjusts the built model (``layer_offset``: the global number of
    its first layer)."""
    from .chunked_loss import gpt_model_class
    from .layer_spec import choose_layer_spec, layer_spec_of, mark_te_norms

    # --transformer-impl and --hetu-attention (layer_spec.py: what each hetu_ext mechanism does under each spec)
    choice = choose_layer_spec(getattr(config, "hetu_transformer_impl", "local"),
                               getattr(config, "hetu_attention", "sdpa"), sequence_parallel=config.sequence_parallel,
                               zero_centered_gamma=config.layernorm_zero_centered_gamma, lora=converter is not None)
    layer_spec = layer_spec_of(choice, qk_layernorm=spec.qk_layernorm, normalization=spec.normalization)
    if converter is not None:
        layer_spec = converter.layer_spec(layer_spec)
    if choice.local_norms:
        layer_spec = _local_norm_block(layer_spec, config)
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    # --hetu-loss-chunk-tokens: GPTModel whose loss runs over token chunks (chunked_loss.py)
    loss_chunk_tokens = getattr(config, "hetu_loss_chunk_tokens", "auto")
    model = gpt_model_class(loss_chunk_tokens)(
        config=config, transformer_layer_spec=layer_spec, vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights,
        position_embedding_type=spec.position_embedding_type, rotary_percent=spec.rotary_percent,
        rotary_base=spec.rotary_base, rope_scaling=spec.rope_scaling,
        rope_scaling_factor=spec.rope_scaling_factor, **kwargs)
    if loss_chunk_tokens:
        model.loss_chunk_tokens = loss_chunk_tokens
    if choice.mark_te_norms:
        mark_te_norms(model, sequence_parallel=config.sequence_parallel,
                      zero_centered_gamma=config.layernorm_zero_centered_gamma)
    if converter is not None:
        converter.convert(model, layer_offset=layer_offset)
    if getattr(config, "hetu_compile", False):
        compile_layers(model)
    return model


def compile_layers(model) -> int:
    """``--hetu-compile``: ``torch.compile`` every transformer layer of ``model`` in place (inductor fuses the
    norms, SwiGLU, RoPE, dropouts and residual adds around the attention kernel); returns how many. CUDA only:
    on CPU hetu_ext disables dynamo (Megatron's unfused paths would compile), so the flag is refused there, in one
    line (ValueError)."""
    import os

    import torch._dynamo

    if torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        raise ValueError("--hetu-compile needs torch.compile, which is disabled in this process "
                         "(TORCHDYNAMO_DISABLE=1: hetu_ext sets it on CPU, where Megatron's unfused paths would "
                         "compile); run on CUDA or drop --hetu-compile")
    layers = transformer_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


class LocalNorm:
    """The local spec's torch norm (Megatron's ``WrappedTorchNorm`` refuses both settings below) built by
    :func:`hetu_ext.megatron.norms.local_norm`:

    * ``--sequence-parallel``: its parameters are marked ``sequence_parallel``: each TP rank sees 1/TP of the
      sequence, so its gradient is a part, summed over the TP group before any other reduction (Megatron's
      finalize_model_grads reads the same mark, which Transformer Engine's norms carry on GPU);
    * ``--apply-layernorm-1p``: the zero-centred norm (weight = gamma - 1, scaling by 1 + weight); its weight is
      marked ``zero_centered_gamma``, so hetu_ext's initialisation stores gamma 1 as 0, Megatron's own value (in
      checkpoints too)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        from .norms import local_norm

        norm = local_norm(config, hidden_size, eps=eps)
        if config.layernorm_zero_centered_gamma:
            norm.weight.zero_centered_gamma = True
        return norm


def _local_norm_block(layer_spec, config):
    """The local spec's layers with :class:`LocalNorm` for every torch norm (the final one included), as a block
    spec of the stage's layers."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = layer_spec.submodules
    for owner, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                        (layer.self_attention.submodules, "q_layernorm"),
                        (layer.self_attention.submodules, "k_layernorm")):
        if getattr(owner, name) is WrappedTorchNorm:
            setattr(owner, name, LocalNorm)
    # a plan's stage model is a one-stage model (pp 1); Megatron's uniform path asks parallel_state
    pp_rank = 0 if config.pipeline_model_parallel_size == 1 else None
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, pp_rank=pp_rank),
                                      layer_norm=LocalNorm)


def optimizer_config(training: TrainingConfig, numerics: TrainingNumerics, *,
                     use_distributed_optimizer: bool = False):
    """Megatron's OptimizerConfig from the training settings (Adam or SGD, LR, weight decay, clipping; ``--fp16``:
    Megatron builds its loss scaler from it, ``DynamicGradScaler`` or under ``--loss-scale`` ``ConstantGradScaler``,
    growth and backoff factors 2 and 0.5 as Megatron-LM).
    ``--decoupled-lr/--decoupled-min-lr``: Megatron-core's parameter groups give the parameters marked
    ``is_embedding_or_output_parameter`` (the word embedding and the output layer) that peak and minimum LR; the
    scheduler reads each group's own ``max_lr``/``min_lr``."""
    from megatron.core.optimizer import OptimizerConfig

    t = training
    return OptimizerConfig(optimizer=t.optimizer, lr=t.lr, min_lr=t.min_lr,
                           decoupled_lr=t.decoupled_lr, decoupled_min_lr=t.decoupled_min_lr,
                           weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
                           adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=t.bf16, fp16=t.fp16,
                           loss_scale=t.loss_scale, initial_loss_scale=t.initial_loss_scale,
                           min_loss_scale=t.min_loss_scale, loss_scale_window=t.loss_scale_window,
                           hysteresis=t.hysteresis, params_dtype=numerics.dtype,
                           use_distributed_optimizer=use_distributed_optimizer)


def with_precision(model, config, numerics: TrainingNumerics):
    """``--bf16`` / ``--fp16``: Megatron's Float16Module (half weights and activations; the optimizer keeps fp32
    masters)."""
    if not numerics.half:
        return model
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, model)


def transformer_layers(model) -> list:
    """The TransformerLayer modules of a stage model (what the straggler monitor's timer times)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]
