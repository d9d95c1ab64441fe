"""Checks of an environment and its verifier: `env_check` (the env contract, run with its oracle and
with garbage), `verifier_check` (the oracle passes, the untouched start fails), and the verifier
audit (`audit`, the contract of an attack, and `attacks` + `attacks_harness`, the built-in library)."""
