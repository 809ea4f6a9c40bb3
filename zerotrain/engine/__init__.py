"""The training step a user calls: forward, backward(loss), step().

The engine composes the parts: it casts and places the model, packs its trainable parameters into
flat buckets (`zero.flat`) or partitions them (stage 3), lets a gradient reducer reduce gradients
during backward and a master optimizer update this rank's fp32 shards, and keeps the step counters,
loss scale and LR schedule. Its API follows DeepSpeed's engine so existing loops port by changing
the import.

- `parts`: `build_parts(...)` -> the frozen `EngineParts`: every choice the config makes (reducer,
  ZeRO++, offloaded optimizer, parameter store), taken once; a forward-only engine gets null parts;
- `weights`: flat buckets (stages 0-2) or stage-3 partitions behind one interface;
- `core`: the micro-step / step state machine over the parts;
- `state`: what the checkpoint is handed (`CheckpointState`: slots, counters, LoCo's buffers);
- `export`: whole weights (full_state_dict, the 16-bit state dict, save_16bit_model, load_state_dict);
- `facade`: `ZeroTrainEngine`, DeepSpeed's engine API as a thin layer over the above.
"""
from .facade import ZeroTrainEngine
from .parts import EngineParts, OptimizerLike, build_parts

__all__ = ["ZeroTrainEngine", "EngineParts", "OptimizerLike", "build_parts"]
