"""Built-in environments and their procedural task generators (registered under the `agentrl/` namespace).

| id | what | tools | verifier |
|---|---|---|---|
| `agentrl/calc-v0` | arithmetic and word problems | python, submit | numeric, gated on using python |
| `agentrl/calc-levels-v0` | calc-v0's arithmetic in difficulty levels (curriculum benchmarks) | python, submit | numeric, gated on using python |
| `agentrl/sqlite-v0` | query or change a SQLite database | bash, python, submit | answer or database state |
| `agentrl/guess-number-v0` | find a secret number from higher/lower feedback | guess | exact match |
| `agentrl/python-repair-v0` | fix a bug planted in a real PyPI package (toolz, inflection, parse, semver) | bash, python, read_file, write_file, str_replace, submit | hidden tests (FAIL_TO_PASS + PASS_TO_PASS, all or nothing) |
"""


def register_builtins() -> None:
    from agentrl.registry import register

    register(
        "agentrl/calc-v0",
        "agentrl.envs.calc:CalcEnv",
        max_turns=4,
        description="Arithmetic and word problems; compute with python, then submit the number.",
    )
    register(
        "agentrl/calc-levels-v0",
        "agentrl.envs.calc_levels:CalcLevelsEnv",
        max_turns=4,
        description="calc-v0's arithmetic in 6 difficulty levels: a mixed pool, or one level with level=N.",
    )
    register(
        "agentrl/sqlite-v0",
        "agentrl.envs.sqlite:SqliteEnv",
        max_turns=8,
        description="A shop database in SQLite: answer questions by querying it, or change it (checked by state).",
    )
    register(
        "agentrl/guess-number-v0",
        "agentrl.envs.guess_number:GuessNumberEnv",
        max_turns=12,
        description="Stateful multi-turn game: find the secret number with higher/lower feedback.",
    )
    register(
        "agentrl/python-repair-v0",
        "agentrl.envs.python_repair.env:PythonRepairEnv",
        max_turns=30,
        description="Fix a bug planted by an AST mutation in a real package; scored by the package's own tests.",
    )
