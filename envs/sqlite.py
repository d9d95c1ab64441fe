"""`agentrl/sqlite-v0`: a small shop database in the sandbox; answer questions by querying it, or change it.

Query tasks are scored by the submitted answer; change tasks by the `state` verifier, which
reads the database after the episode with a fixed query and compares it with the expected
result. The database is built fresh in every episode from the task's SQL.
"""

from __future__ import annotations

import random
import shlex
import sqlite3
from typing import Any

from pydantic import Field

from agentrl.core.task import Task, split_rng_seed
from agentrl.core.types import Message, Split
from agentrl.env.agents import ScriptedOracle, last_tool_output
from agentrl.env.settings import ToolEnvSettings
from agentrl.env.tool_env import ToolEnv

CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Pune", "Quito", "Seoul", "Tunis"]
FIRST = ["Ada", "Bo", "Cyd", "Dee", "Eve", "Finn", "Gus", "Hal", "Ida", "Jo", "Kai", "Lu", "Mo", "Ned", "Ola"]
PRODUCTS = ["lamp", "chair", "desk", "mug", "pen", "bag", "kettle", "clock", "plant", "rug", "fan", "book"]
DB = "shop.db"
SCHEMA = """CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL, age INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, price REAL NOT NULL, stock INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL);
"""
# The state check: one line per product and a count of orders, so any unintended change shows.
CHECK_SQL = (
    "SELECT group_concat(name || ':' || stock || ':' || price, ',') FROM (SELECT * FROM products ORDER BY id); "
    "SELECT count(*) || ' orders' FROM orders; SELECT count(*) || ' customers' FROM customers;"
)


def _sql_literal(v: Any) -> str:
    return "'" + str(v).replace("'", "''") + "'" if isinstance(v, str) else repr(v)


def _build(rng: random.Random) -> tuple[str, sqlite3.Connection]:
    lines = [SCHEMA]
    names = rng.sample(FIRST, rng.randint(8, 14))
    for i, name in enumerate(names, 1):
        lines.append(
            f"INSERT INTO customers VALUES ({i}, '{name}', '{rng.choice(CITIES)}', {rng.randint(18, 80)});"
        )
    prods = rng.sample(PRODUCTS, rng.randint(6, 10))
    for i, p in enumerate(prods, 1):
        lines.append(
            f"INSERT INTO products VALUES ({i}, '{p}', {rng.randint(2, 200)}.{rng.choice([0, 5])}, {rng.randint(0, 50)});"
        )
    for i in range(1, rng.randint(10, 30) + 1):
        lines.append(
            f"INSERT INTO orders VALUES ({i}, {rng.randint(1, len(names))}, {rng.randint(1, len(prods))}, "
            f"{rng.randint(1, 9)});"
        )
    sql = "\n".join(lines) + "\n"
    con = sqlite3.connect(":memory:")
    con.executescript(sql)
    return sql, con


def _check_output(con: sqlite3.Connection) -> str:
    rows = []
    for stmt in CHECK_SQL.split(";"):
        if stmt.strip():
            rows.append(str(con.execute(stmt).fetchone()[0] or ""))
    return "\n".join(rows)


class SqliteTaskGenerator:
    def __init__(self, seed: int = 0, change_fraction: float = 0.35):
        self.seed = seed
        self.change_fraction = change_fraction

    def generate(self, index: int, split: Split = "train") -> Task:
        rng = random.Random(split_rng_seed(self.seed, split, index))
        sql, con = _build(rng)
        cities = [r[0] for r in con.execute("SELECT DISTINCT city FROM customers")]
        products = [r[0] for r in con.execute("SELECT name FROM products")]
        customers = [r[0] for r in con.execute("SELECT name FROM customers")]
        base = dict(
            id=f"sqlite/{split}/{index}",
            files={"setup.sql": sql},
            setup=[f"sqlite3 {DB} < setup.sql && rm setup.sql"],
            split=split,
        )
        intro = f"The SQLite database `{DB}` in your workspace has tables customers, products and orders. "
        if rng.random() < self.change_fraction:
            kind = rng.choice(["set_stock", "delete_orders", "raise_price"])
            if kind == "set_stock":
                p, n = rng.choice(products), rng.randint(0, 99)
                q, solution = (
                    f"Set the stock of the product '{p}' to {n}.",
                    f"UPDATE products SET stock = {n} WHERE name = {_sql_literal(p)};",
                )
            elif kind == "delete_orders":
                c = rng.choice(customers)
                q = f"Delete every order placed by the customer named '{c}'."
                solution = f"DELETE FROM orders WHERE customer_id = (SELECT id FROM customers WHERE name = {_sql_literal(c)});"
            else:
                p = rng.choice(products)
                q = f"Increase the price of the product '{p}' by 10 (prices are in dollars)."
                solution = f"UPDATE products SET price = price + 10 WHERE name = {_sql_literal(p)};"
            con.executescript(solution)
            check = f"sqlite3 -init /dev/null -batch {DB} {shlex.quote(CHECK_SQL)}"
            return Task(
                **base,
                prompt=intro + q + " Then call submit with the answer 'done'.",
                answer=_check_output(con),
                check_command=check,
                metadata={"kind": kind, "solution_sql": solution, "mutates": True},
            )
        kind = rng.choice(["count_city", "total_quantity", "max_price", "oldest", "orders_of"])
        if kind == "count_city":
            city = rng.choice(cities)
            q, solution = (
                f"How many customers live in {city}?",
                f"SELECT COUNT(*) FROM customers WHERE city = '{city}';",
            )
        elif kind == "total_quantity":
            p = rng.choice(products)
            q = f"What is the total quantity ordered of the product '{p}'?"
            solution = (
                "SELECT COALESCE(SUM(o.quantity), 0) FROM orders o JOIN products p ON p.id = o.product_id "
                f"WHERE p.name = {_sql_literal(p)};"
            )
        elif kind == "max_price":
            q, solution = (
                "What is the price of the most expensive product?",
                "SELECT MAX(price) FROM products;",
            )
        elif kind == "oldest":
            q, solution = (
                "What is the name of the oldest customer? (If several, the one with the smallest id.)",
                "SELECT name FROM customers ORDER BY age DESC, id ASC LIMIT 1;",
            )
        else:
            c = rng.choice(customers)
            q = f"How many orders did the customer named '{c}' place?"
            solution = f"SELECT COUNT(*) FROM orders WHERE customer_id = (SELECT id FROM customers WHERE name = {_sql_literal(c)});"
        answer = con.execute(solution).fetchone()[0]
        if isinstance(answer, float) and answer.is_integer():
            answer = f"{answer:.1f}"
        return Task(
            **base,
            prompt=intro + q + " Submit just the answer.",
            answer=str(answer),
            metadata={"kind": kind, "solution_sql": solution, "mutates": False},
        )


class SqliteOracle(ScriptedOracle):
    def act(self, observation: list[Message]) -> str:
        out = last_tool_output(observation)
        if not out:
            sql = self.task.metadata["solution_sql"]
            return self.call("bash", command=f"sqlite3 -batch {DB} {shlex.quote(sql)}")
        return self.call(
            "submit", answer="done" if self.task.metadata["mutates"] else out.strip().splitlines()[0]
        )


class SqliteSettings(ToolEnvSettings):
    """sqlite-v0's settings: ToolEnv's, with its own tools, verifier and turn limit."""

    tools: list[Any] | None = Field(
        default_factory=lambda: ["bash", "python", "submit"],
        description="The tools the agent calls (@agentrl.tool functions or built-in names).",
    )
    verifier: Any = Field(
        "auto",
        description="How an episode is scored: auto checks a query task's answer and a change task's database "
        "state; or a verifier's name, (name, kwargs), or a Verifier.",
    )
    max_turns: int = Field(8, ge=1, description="Most assistant messages per episode.")


class SqliteEnv(ToolEnv):
    settings_model = SqliteSettings
    task_generator = SqliteTaskGenerator
    instructions = (
        "You are a database assistant. Inspect and query the SQLite database with the tools "
        "(the sqlite3 command-line shell is installed), then call submit."
    )

    def oracle(self, task: Task) -> SqliteOracle:
        return SqliteOracle(task, self.parser)
