"""`python -m agentrl.cli`: the `agentrl` command."""

from agentrl.cli import main

if __name__ == "__main__":
    main()
