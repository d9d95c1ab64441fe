"""The local model kit and the demo built on it. Nothing in the core imports this package.

There is no model hub on our machines, so the demo and the tests build their own model:

- `tiny_model`: a tiny Qwen2-architecture checkpoint, loadable like a real one;
- `tokenizer`: its byte-level BPE tokenizer and chat template;
- `demonstrations`: an environment's oracle played through the rollout engine, as SFT data;
- `warm_start`: tiny model -> demonstrations -> SFT, into RL's learnability band (cached);
- `demo`: warm start -> GRPO -> pass@k before and after (`agentrl demo`).
"""
