"""README.md's fenced commands, as a shell would see them: blocks, commands
(continuation lines joined, comments dropped), shell variables expanded.
Tests run the commands, or parse them against the real parsers."""
from __future__ import annotations

import os
import re
import shlex

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO_ROOT, "README.md")
# What `$(python -c "import maxtext ...")/configs/base.yml` stands for when
# a command is only parsed.
BASE_PLACEHOLDER = "/maxtext/configs/base.yml"


def readme() -> str:
  with open(README) as f:
    return f.read()


def blocks(language: str, section: str | None = None) -> list[str]:
  """The fenced blocks of `language`, of one `## section` if given."""
  text = readme()
  if section is not None:
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text,
                      re.M | re.S)
    assert match, f"README has no section {section!r}"
    text = match.group(1)
  return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def commands(block: str) -> list[str]:
  """One string per command: continuation lines joined, comments cut."""
  joined = re.sub(r"\\\n\s*", " ", block)
  out = []
  for line in joined.splitlines():
    line = re.sub(r"(^|\s)#.*$", "", line).strip()
    if line:
      out.append(line)
  return out


def is_assignment(command: str) -> bool:
  return re.match(r"^[A-Z_][A-Z0-9_]*=", command) is not None


def variables(block: str) -> dict[str, str]:
  """The block's NAME=value assignments (a command substitution stands for
  MaxText's base.yml)."""
  found = {}
  for command in commands(block):
    if is_assignment(command):
      name, _, value = command.partition("=")
      if value.startswith("$("):
        assert value.endswith("/configs/base.yml"), command
        found[name] = BASE_PLACEHOLDER
      else:
        found[name] = " ".join(shlex.split(value))
  return found


def argv(command: str, names: dict[str, str]) -> list[str]:
  """The command's words with $NAME expanded (unquoted: split on spaces,
  as the shell splits them)."""
  expanded = re.sub(r"\$([A-Z_][A-Z0-9_]*)",
                    lambda m: names.get(m.group(1), m.group(0)), command)
  return shlex.split(expanded)


def pip_extras(words: list[str]) -> list[str]:
  """The extras a `pip install -e ".[a,b]"` names."""
  extras = []
  for word in words:
    match = re.fullmatch(r"\.\[([\w,-]+)\]", word)
    if match:
      extras += match.group(1).split(",")
  return extras


def setup_extras() -> set[str]:
  """setup.py's extras_require keys, read from its syntax tree (neither run
  nor dependent on setuptools, which a Python 3.12 venv lacks)."""
  import ast  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO_ROOT, "setup.py")) as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == "extras_require":
      assert isinstance(node.value, ast.Dict), "extras_require is no dict"
      return {ast.literal_eval(key) for key in node.value.keys}
  raise AssertionError("setup.py has no extras_require")
