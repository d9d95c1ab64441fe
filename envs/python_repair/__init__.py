"""`agentrl/python-repair-v0`: repair a bug planted by an AST mutation in a real PyPI package.

- `packages`: the pinned sdists and how each splits into workspace source and hidden tests;
- `images`: one sandbox image per package (`agentrl sandbox build`);
- `mutate`: the AST mutation operators (pure functions of a module's source);
- `synth`: the task synthesizer (runs the package's tests on the original and on each mutant);
- `env`: the environment, its oracle, and task statistics.
"""
