"""The core: what every stage shares.

Modules: `types` (`Message`, `Split`, `FinishReason`, `StepInfo`, `Verdict`, each defined once),
`errors` (`UserError` and the one-line errors), `task` (`Task`), `episode` (`Episode`), `runlog` (run
logs), `deadline` (calls with a deadline), `plugins` (the one plugin registry over entry-point groups),
`interrupt` (Ctrl-C raised from a running event loop, outside its tasks).
"""
