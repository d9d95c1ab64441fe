"""Built-in environments and their procedural task generators (registered under the `agentrl/` namespace).

| id | what | tools | verifier |
|---|---|---|---|
| `agentrl/calc-v0` | arithmetic and word problems | python, submit | numeric, gated on using python |
| `agentrl/calc-levels-v0` | calc-v0's arithmetic in difficulty levels (curriculum benchmarks) | python, submit | numeric, gated on using python |
| `agentrl/sqlite-v0` | query or change a SQLite database | bash, python, submit | answer or database state |
| `agentrl/sqlite-mcp-v0` | sqlite-v0's tasks, tools from the reference MCP server `mcp-server-sqlite` in the sandbox | read_query, write_query, list_tables, describe_table (the server's), submit | answer or database state |
| `agentrl/guess-number-v0` | find a secret number from higher/lower feedback | guess | exact match |
| `agentrl/python-repair-v0` | fix a bug planted in a real PyPI package (toolz, inflection, parse, semver) | bash, python, read_file, write_file, str_replace, submit | hidden tests (FAIL_TO_PASS + PASS_TO_PASS, all or nothing) |

`agentrl.env.registry.BUILTINS` registers them by entry-point string (`"agentrl.envs.calc:CalcEnv"`):
importing agentrl imports none of their modules.
"""
