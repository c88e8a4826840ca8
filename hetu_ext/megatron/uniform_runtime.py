"""Megatron's own uniform path: parallel_state's TP x PP x DP grid, its DDP, optimizer, schedule and grad sync."""

from __future__ import annotations

from hetu_ext.config import TrainingConfig
from hetu_ext.plan import ModelSpec, Plan, uniform_shape

from . import host
from .model import TrainingNumerics, build_gpt_stage, optimizer_config, transformer_config, with_precision
from .placement import Placement
from .weights import init_weights


def build_megatron_placement(training: TrainingConfig, spec: ModelSpec, plan: Plan, h: host.Host,
                             numerics: TrainingNumerics, *, use_distributed_optimizer: bool = False) -> Placement:
    """Megatron's own uniform path: parallel_state's TP x PP x DP grid, its DDP, optimizer and schedule."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tp, pp, _ = uniform_shape(plan)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(training.seed)
    pipeline_index, stage_index = plan.stage_of(h.rank)
    stage = plan.pipelines[pipeline_index].stages[stage_index]
    config = transformer_config(spec, numerics, tp=tp, pp=pp, on_cpu=h.device.type == "cpu")
    model = build_gpt_stage(spec, config, pre_process=stage.has_embedding, post_process=stage.has_output)
    model.to(h.device)
    init_weights(model, seed=training.seed, std=numerics.init_method_std, num_layers=spec.num_layers)
    model = with_precision(model, config, numerics)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=numerics.grad_reduce_in_fp32,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    model.broadcast_params()
    opt_config = optimizer_config(training, numerics, use_distributed_optimizer=use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, [model], use_gloo_process_groups=False)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return Placement(active=True, pipeline_index=pipeline_index, model=model, optimizer=optimizer, config=config,
                     is_last_stage=stage.has_output, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                     report_group=None, forward_backward=get_forward_backward_func())
