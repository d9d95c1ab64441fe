"""Stage 3 of the pipeline: trajectories become weight updates.

The recipes read top to bottom: `trainer` (GRPO with the learnability curriculum under FSDP2) and
`sft` (masked supervised fine-tuning). Their components:

- `config`: `TrainConfig`, every knob of `agentrl train`;
- `grpo`: advantages and the clipped policy loss (pure functions);
- `batch`, `packing`, `varlen`, `logprobs`: trajectories to tensors, micro-batches by a token budget,
  packed rows, log-probs from hidden states at the action tokens only;
- `curriculum`: the learnability band and dynamic sampling;
- `distributed`, `placement`, `weight_sync`: FSDP2, where the trainer and the engine run on GPUs,
  and the weight push;
- `checkpoint`, `tracking`, `peak_memory`: resumable checkpoints, metrics sinks, memory measurement.
"""

from typing import Any as _Any


def __getattr__(name: str) -> _Any:
    # What `agentrl.train` held when it was one module, kept importable for a while (deprecated).
    from agentrl._moved import forward_old_names

    return forward_old_names(__name__, name)
