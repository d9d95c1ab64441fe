"""Stage 4 of the pipeline: did the policy get better?

- `evaluate`: budget-controlled, resumable pass@k evaluation of checkpoints (the recipe);
- `passk`: pass@k, pass^k and their confidence intervals (pure functions);
- `report`: summaries, Markdown reports and plots.
"""
