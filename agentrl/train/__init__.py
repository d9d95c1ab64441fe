"""Stage 3 of the pipeline: trajectories become weight updates.

The recipes read top to bottom: `trainer` (GRPO with the learnability curriculum under FSDP2) and
`sft` (masked supervised fine-tuning). Their components:

- `config`: `TrainConfig`, every knob of `agentrl train`;
- `grpo`: advantages and the clipped policy loss (pure functions);
- `batch`, `packing`, `varlen`, `logprobs`: trajectories to tensors, micro-batches by a token budget,
  packed rows, log-probs from hidden states at the action tokens only;
- `curriculum`: the learnability band, dynamic sampling and adaptive difficulty (`build_curriculum`);
- `producer`: rank 0's rollouts, turning the curriculum's draws into batches;
- `distributed`: FSDP2 under torchrun (where the engine runs and how weights reach it is the rollout
  stage's: `agentrl.rollout.placement`, `agentrl.rollout.weight_sync`);
- `lora`: LoRA adapters (peft) injected in place, only they train; saved in peft's format, merged into a
  full model by `agentrl model merge`;
- `stopping`: Ctrl-C and runs with nothing to learn from;
- `checkpoint`, `tracking`, `plot`, `peak_memory`: resumable checkpoints, metrics sinks, the training
  plot, memory measurement.
"""
