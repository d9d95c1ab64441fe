"""Stage 2 of the pipeline: a policy plays many multi-turn episodes at once, token ids in and out.

- `policy`: the `Policy` contract (ids in, sampled ids and their log-probs out) and its engines;
  `ray_policy`: several engines on a Ray cluster as one policy;
- `engine`: `make_policy`, the one way an engine is started (for training, evaluation and the CLI);
- `placement`, `weight_sync`: where the engine runs beside a trainer on GPUs, and how new weights
  reach it (both ends of the push, the sleep and wake around it);
- `masker`: the observation-token masker (sampled ids mask 1, environment ids mask 0);
- `trajectory`: `Trajectory`, one finished episode as the trainer sees it; `assemble`: the one builder
  of trajectories from masked sequences;
- `loop`: the rollout loop, `collect`: generate -> step -> append for every episode in flight;
- `driver`: the protocol of an episode an agent outside the loop plays (a harness's, implemented by the
  gateway, the stage above: the rollout never imports it).
"""
