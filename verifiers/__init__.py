"""Verifier plugins: score an episode from the sandbox's final state (`verify(sandbox, task, episode) -> Verdict`)."""
