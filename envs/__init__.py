"""Built-in environments and their procedural task generators (registered under the `agentrl/` namespace)."""
