"""Pipeline parallelism (DeepSpeed's `deepspeed.pipe`) on `torch.distributed.pipelining`'s schedules.

`PipelineModule(layers=[LayerSpec / TiedLayerSpec / modules...], num_stages, loss_fn, partition_method)` is
cut into stages; `zerotrain.initialize(model=PipelineModule(...))` returns a `PipelineEngine` whose
`train_batch(data_iter)` / `eval_batch(data_iter)` run one batch of `gradient_accumulation_steps` micro-batches
(docs/pipeline.md).
"""
from .engine import PipelineEngine, PipelinePlan, check_pipeline_config, pipeline_size, prepare_pipeline
from .hf import CausalLMPipeline, causal_lm_pipeline, pipeline_model
from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .schedule import Placement, schedule_class

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineEngine", "PipelinePlan", "prepare_pipeline",
           "check_pipeline_config", "pipeline_size", "CausalLMPipeline",
           "causal_lm_pipeline", "pipeline_model", "Placement", "schedule_class"]
